/* nx_sigbus.c -- see nx_sigbus.h. Only async-signal-safe calls inside the handler. */
#define _POSIX_C_SOURCE 200809L
#include "nx_sigbus.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

static char nx_sigbus_msg[1024];
static size_t nx_sigbus_len;
static volatile pid_t nx_sigbus_pid;
static volatile int nx_sigbus_code;
static struct sigaction nx_sigbus_old; /* the action before the first install */
static int nx_sigbus_installed;

static void nx_sigbus_default(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, NULL);
}

static void nx_on_sigbus(int sig) {
    (void)sig;
    if (getpid() == nx_sigbus_pid) {
        size_t off = 0;
        while (off < nx_sigbus_len) {
            ssize_t w = write(STDERR_FILENO, nx_sigbus_msg + off, nx_sigbus_len - off);
            if (w <= 0)
                break;
            off += (size_t)w;
        }
        _exit(nx_sigbus_code);
    }
    nx_sigbus_default(); /* a forked worker: the retried load kills it by SIGBUS */
}

int nx_sigbus_install(const char *msg, int code) {
    size_t n = strlen(msg);
    if (n > sizeof nx_sigbus_msg - 1)
        n = sizeof nx_sigbus_msg - 1;
    memcpy(nx_sigbus_msg, msg, n);
    nx_sigbus_msg[n] = 0;
    nx_sigbus_len = n;
    nx_sigbus_code = code;
    nx_sigbus_pid = getpid();
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = nx_on_sigbus;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, nx_sigbus_installed ? NULL : &nx_sigbus_old) != 0)
        return -1;
    nx_sigbus_installed = 1;
    return 0;
}

int nx_sigbus_uninstall(void) {
    if (!nx_sigbus_installed)
        return 0;
    if (sigaction(SIGBUS, &nx_sigbus_old, NULL) != 0)
        return -1;
    nx_sigbus_installed = 0;
    return 0;
}
