/* nx_sigbus.h -- the CLIs' answer to SIGBUS: one line and an exit code, not a silent crash.
 *
 * A read of a memory-mapped file beyond its current end raises SIGBUS: a model file truncated
 * or rewritten in place while a run maps it. Python cannot handle that signal (its handlers run
 * later, after the faulting load has been retried), so the CLIs install this C handler.
 * In the process that installed it, the handler writes the message to stderr and _exit()s with
 * the code. In a forked child (a worker) it restores the default action and returns: the load
 * faults again and the child dies by SIGBUS, which its pool reports as a crash.
 * Must not: be installed by the library on its own (a downstream program owns its signals).
 */
#ifndef NX_SIGBUS_H
#define NX_SIGBUS_H

/* Install the handler: msg (copied, at most 1023 bytes kept), exit code. 0, or -1 (errno). */
int nx_sigbus_install(const char *msg, int code);
/* Restore the SIGBUS action from before the first install (no-op if none). 0, or -1. */
int nx_sigbus_uninstall(void);

#endif
