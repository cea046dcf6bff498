/* A process that sees an AVX2 CPU: LD_PRELOADed (bench/kit/isa.py builds and loads it), it hides AVX-512, VNNI
 * (AVX-512 and AVX-VNNI), AVX-512 FP16/BF16 and AMX from CPUID, so that onnxruntime (MLAS), numpy and every other
 * library pick the kernels they would pick on an AVX2 + FMA CPU such as the AMD EPYC of issue 33, on these cores.
 *
 * How: Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID 0, where /proc/cpuinfo lists cpuid_fault) makes every
 * CPUID instruction of this process raise SIGSEGV; the handler runs the real CPUID with faulting briefly off,
 * clears the hidden bits, writes the four registers back and steps over the instruction. The setting is inherited
 * by the threads created after it and reset by execve, where LD_PRELOAD loads this again.
 *
 * Some programs install a SIGSEGV handler of their own (Python's faulthandler, which pytest enables): sigaction()
 * is interposed so that this handler stays first and hands every other fault on to theirs. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define BIT(n) (1u << (n))

/* CPUID leaf 7, subleaf 0 (EBX, ECX, EDX) and subleaf 1 (EAX, EDX): the bits hidden, named as in /proc/cpuinfo. */
static const unsigned HIDE_7_0_EBX = BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31);
/* avx512f avx512dq avx512ifma avx512pf avx512er avx512cd avx512bw avx512vl */
static const unsigned HIDE_7_0_ECX = BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14);
/* avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq */
static const unsigned HIDE_7_0_EDX = BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25);
/* avx512_4vnniw avx512_4fmaps avx512_vp2intersect amx_bf16 avx512_fp16 amx_tile amx_int8 */
static const unsigned HIDE_7_1_EAX = BIT(4) | BIT(5) | BIT(23);  /* avx_vnni avx512_bf16 avx_ifma */
static const unsigned HIDE_7_1_EDX = BIT(4) | BIT(5) | BIT(10);  /* avx_vnni_int8 avx_ne_convert avx_vnni_int16 */

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
static sigaction_fn real_sigaction;
static struct sigaction theirs; /* the program's own SIGSEGV handler, called for every fault that is not CPUID */
static int installed;            /* ours is in place: the program's SIGSEGV handler goes to `theirs` */

static void cpuid_faults(int on) { syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1); }

static void hand_on(int sig, siginfo_t *info, void *context) {
    if (theirs.sa_flags & SA_SIGINFO) {
        theirs.sa_sigaction(sig, info, context);
    } else if (theirs.sa_handler != SIG_DFL && theirs.sa_handler != SIG_IGN) {
        theirs.sa_handler(sig);
    } else { /* nobody else handles it: the default action, when the faulting instruction runs again */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        real_sigaction(SIGSEGV, &dfl, NULL);
        if (info->si_code != SI_KERNEL) { /* sent (kill, raise): nothing runs again, so send it once more */
            raise(sig);
        }
    }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    greg_t *regs = ((ucontext_t *)context)->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)regs[REG_RIP];
    if (info->si_code != SI_KERNEL || ip[0] != 0x0f || ip[1] != 0xa2) {
        hand_on(sig, info, context);
        return;
    }
    unsigned leaf = (unsigned)regs[REG_RAX], subleaf = (unsigned)regs[REG_RCX], a, b, c, d;
    cpuid_faults(0);
    __cpuid_count(leaf, subleaf, a, b, c, d);
    cpuid_faults(1);
    if (leaf == 7 && subleaf == 0) {
        b &= ~HIDE_7_0_EBX;
        c &= ~HIDE_7_0_ECX;
        d &= ~HIDE_7_0_EDX;
    } else if (leaf == 7 && subleaf == 1) {
        a &= ~HIDE_7_1_EAX;
        d &= ~HIDE_7_1_EDX;
    }
    regs[REG_RAX] = a;
    regs[REG_RBX] = b;
    regs[REG_RCX] = c;
    regs[REG_RDX] = d;
    regs[REG_RIP] += 2; /* CPUID is 0F A2 */
}

static sigaction_fn the_real_sigaction(void) {
    if (real_sigaction == NULL) { /* another library's constructor may call sigaction before ours ran */
        real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    }
    return real_sigaction;
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (sig != SIGSEGV || !installed) {
        return the_real_sigaction()(sig, act, old);
    }
    if (old != NULL) {
        *old = theirs;
    }
    if (act != NULL) {
        theirs = *act;
    }
    return 0;
}

__attribute__((constructor)) static void hide_features(void) {
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_segv;
    ours.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    if (the_real_sigaction()(SIGSEGV, &ours, &theirs) == 0) {
        installed = 1;
        cpuid_faults(1);
    }
}
