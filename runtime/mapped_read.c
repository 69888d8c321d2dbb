/* mapped_read.c - a SIGBUS guard around the copies out of a file's mapping.
 * STYLE.md rules out longjmp on any path a user can reach; this is the one accepted
 * exception: a thread-local sigjmp_buf is armed only while kiln_mapped_read runs a
 * memcpy/kiln_convert from a mapping (no lock held, nothing allocated, nothing to
 * unwind in between), and the SIGBUS handler, installed once, jumps back there only
 * when the fault is on this thread and inside the armed source range. Any other
 * SIGBUS goes to the handler that was there before (ASan's, a host's, the default),
 * so a real bus error still behaves as it did. */
#define _GNU_SOURCE
#include "mapped_read.h"

#include "convert.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

typedef struct {
    sigjmp_buf jb;
    const char *lo, *hi;   /* the source range being read */
    volatile sig_atomic_t armed;
} guard;

/* Thread-local, touched by the arming thread before it can fault, so the handler's
 * access needs no allocation. */
static _Thread_local guard *current;

static struct sigaction previous;
static pthread_once_t installed = PTHREAD_ONCE_INIT;
static int install_ok;

static void chain(int sig, siginfo_t *si, void *uc)
{
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction) previous.sa_sigaction(sig, si, uc);
        return;
    }
    if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
        /* back to the default: the faulting instruction runs again and the process
         * ends with the signal, as it would have without us */
        signal(sig, SIG_DFL);
        return;
    }
    previous.sa_handler(sig);
}

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
    guard *g = current;
    if (g && g->armed && si && (const char *)si->si_addr >= g->lo && (const char *)si->si_addr < g->hi) {
        g->armed = 0;
        siglongjmp(g->jb, 1);
    }
    chain(sig, si, uc);
}

static void install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    install_ok = sigaction(SIGBUS, &sa, &previous) == 0;
}

kiln_status kiln_mapped_read(const char *path, void *dst, kiln_dtype ddt, const void *src, kiln_dtype sdt,
                             size_t n)
{
    if (!path || n == 0) {
        kiln_convert(dst, ddt, src, sdt, n);
        return KILN_OK;
    }
    pthread_once(&installed, install);
    if (!install_ok) {
        kiln_convert(dst, ddt, src, sdt, n);
        return KILN_OK;
    }
    guard g;
    guard *volatile outer = current; /* a nested guard (none today) is put back */
    g.lo = src;
    g.hi = (const char *)src + kiln_dtype_nbytes(sdt, (int64_t)n);
    g.armed = 0;
    current = &g;
    /* savemask 0: saving the mask is a system call on every copy; the jump out of the
     * handler instead unblocks SIGBUS (blocked while the handler runs) itself */
    if (sigsetjmp(g.jb, 0)) {
        sigset_t bus;
        sigemptyset(&bus);
        sigaddset(&bus, SIGBUS);
        pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
        current = outer;
        return kiln_error(KILN_ERR_IO, "%s changed on disk while it was read (truncated? a read past its end "
                          "faulted): reopen it", path);
    }
    g.armed = 1;
    atomic_signal_fence(memory_order_seq_cst);
    kiln_convert(dst, ddt, src, sdt, n);
    atomic_signal_fence(memory_order_seq_cst);
    g.armed = 0;
    current = outer;
    return KILN_OK;
}

kiln_status kiln_mapped_read_bytes(const char *path, void *dst, const void *src, size_t n)
{
    return kiln_mapped_read(path, dst, KILN_U8, src, KILN_U8, n);
}
