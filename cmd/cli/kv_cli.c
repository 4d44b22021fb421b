/*
 * The shared front end: option parsing driven by one table per tool (which
 * also renders --help), messages on stderr, exit codes, TTY and NO_COLOR
 * detection, and a progress line that appears only on a terminal.
 */
#include "kv_cli.h"
#include "common/kv_outfile.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpu/kv_gpu.h"
#include "format/kvc.h"

int kv_verbosity = 0;
int kv_progress_mode = -1;
const char *kv_cli_version_extra = NULL;

static const kv_cli_spec *the_spec;
static const char *progname = "kv";

enum { OPT_HELP = 'h', OPT_VERSION = 'V', OPT_QUIET = 'q', OPT_VERBOSE = 'v',
       OPT_PROGRESS = 0x7f00, OPT_NO_PROGRESS };

static const kv_option common_opts[] = {
    {OPT_HELP, 'h', "help", NULL, "show this help and exit"},
    {OPT_VERSION, 'V', "version", NULL, "show version, format version and CUDA/GPU status"},
    {OPT_QUIET, 'q', "quiet", NULL, "fewer messages (repeatable)"},
    {OPT_VERBOSE, 'v', "verbose", NULL, "more messages (repeatable)"},
    {OPT_PROGRESS, 0, "progress", NULL, "show progress even when stderr is not a terminal"},
    {OPT_NO_PROGRESS, 0, "no-progress", NULL, "never show progress"},
    {0, 0, NULL, NULL, NULL},
};

const char *kv_progname(void) { return progname; }

/* On SIGINT/SIGTERM/SIGHUP/SIGPIPE remove temp files of unfinished atomic
 * writes, then die of the same signal so the parent sees why. */
static void on_fatal_signal(int sig)
{
    kv_outfile_cleanup_all();
    signal(sig, SIG_DFL);
    raise(sig);
}

void kv_cli_init(const kv_cli_spec *spec, int argc, char **argv)
{
    (void)argc;
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_fatal_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(sigs[i], &sa, NULL);
    }
    the_spec = spec;
    progname = spec->name;
    if (argv && argv[0]) {
        const char *slash = strrchr(argv[0], '/');
        const char *base = slash ? slash + 1 : argv[0];
        if (strncmp(base, "kv-", 3) == 0) progname = base;
    }
}

static void print_opts(FILE *f, const kv_option *o)
{
    for (; o->id; o++) {
        if (!o->help) continue; /* a deprecated spelling: works, not shown */
        char left[96];
        int n = 0;
        if (o->short_name)
            n += snprintf(left + n, sizeof left - (size_t)n, "-%c%s", o->short_name,
                          o->long_name ? ", " : "");
        else
            n += snprintf(left + n, sizeof left - (size_t)n, "    ");
        if (o->long_name)
            n += snprintf(left + n, sizeof left - (size_t)n, "--%s", o->long_name);
        if (o->arg)
            snprintf(left + n, sizeof left - (size_t)n, " %s", o->arg);
        if (strlen(left) > 26)
            fprintf(f, "  %s\n  %-26s  %s\n", left, "", o->help);
        else
            fprintf(f, "  %-26s  %s\n", left, o->help);
    }
}

static void print_usage(FILE *f, bool full)
{
    fprintf(f, "usage: %s %s\n", progname, the_spec->synopsis);
    if (!full) {
        fprintf(f, "Try '%s --help' for more information.\n", progname);
        return;
    }
    fprintf(f, "%s\n\nOptions:\n", the_spec->summary);
    if (the_spec->opts) print_opts(f, the_spec->opts);
    print_opts(f, common_opts);
    if (the_spec->epilog) fprintf(f, "\n%s\n", the_spec->epilog);
    fprintf(f, "\nExit status: 0 ok, 64 usage, 65 bad data, 66 no input, 69 unavailable,\n"
               "70 internal, 73 cannot create output, 74 I/O error.\n");
}

static void print_version(void)
{
    char gpu[128];
    int ndev = kv_gpu_probe(gpu, sizeof gpu);
    printf("%s %s\n", progname, KV_VERSION);
    printf("kvc format version %d\n", KVC_FORMAT_VERSION);
    printf("CUDA: %s\n", kv_gpu_built() ? "built in" : "not built");
    if (kv_gpu_built())
        printf("GPU: %s\n", ndev > 0 ? gpu : "none usable");
    if (kv_cli_version_extra) printf("%s\n", kv_cli_version_extra);
}

/* "prog: " + fmt + detail (NULL for none) + newline on stderr, with every
 * control character from arguments, paths or input written as \xNN
 * (kv_escape_controls): a message must not be able to drive the terminal. */
static void vline(const char *fmt, va_list ap, const char *detail)
{
    char raw[2048], out[4 * sizeof raw];
    int n = vsnprintf(raw, sizeof raw, fmt, ap);
    if (detail && n >= 0) {
        /* a message that fills the buffer (a long path) is cut, not the
           reason after it: "cannot open ...: No such file" must stay */
        size_t at = (size_t)n, room = strlen(detail) + 8 < sizeof raw / 2 ? strlen(detail) + 8 : sizeof raw / 2;
        if (at >= sizeof raw - room) {
            at = sizeof raw - room;
            memcpy(raw + at - 3, "...", 3);
        }
        snprintf(raw + at, sizeof raw - at, ": %s", detail);
    }
    kv_escape_controls(out, sizeof out, raw);
    fprintf(stderr, "%s: %s\n", progname, out);
}

static void line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void line(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vline(fmt, ap, NULL);
    va_end(ap);
}

#define MAX_OPTS 96

/* "-t is deprecated here: use --temp" (the entry of the same id that has
 * help names the current spelling), once per old spelling.  alias is a
 * short-only or a long-only entry without help. */
static void deprecated(const kv_option *alias)
{
    static const kv_option *said[MAX_OPTS];
    static int n_said;
    for (int i = 0; i < n_said; i++)
        if (said[i] == alias) return;
    if (n_said < MAX_OPTS) said[n_said++] = alias;
    char old[64];
    if (alias->long_name) snprintf(old, sizeof old, "--%s", alias->long_name);
    else snprintf(old, sizeof old, "-%c", alias->short_name);
    const kv_option *now = NULL;
    for (const kv_option *o = the_spec->opts; o && o->id; o++)
        if (o->id == alias->id && o->help && o->long_name) now = o;
    if (now && now->short_name)
        kv_warn("%s is deprecated here: use -%c or --%s", old, now->short_name, now->long_name);
    else if (now)
        kv_warn("%s is deprecated here: use --%s", old, now->long_name);
    else
        kv_warn("%s is deprecated", old);
}

int kv_cli_next(int argc, char **argv, const char **arg, int *optind_out)
{
    static struct option longs[MAX_OPTS];
    static const kv_option *long_of[MAX_OPTS]; /* the entry of each longs[] */
    static char shorts[MAX_OPTS * 2 + 2];
    static bool built = false;
    if (!built) {
        int nl = 0, ns = 0;
        shorts[ns++] = ':'; /* report missing arguments distinctly */
        const kv_option *tables[2] = {the_spec->opts, common_opts};
        for (int t = 0; t < 2; t++) {
            for (const kv_option *o = tables[t]; o && o->id; o++) {
                if (o->long_name && nl < MAX_OPTS - 1) {
                    long_of[nl] = o;
                    longs[nl++] = (struct option){o->long_name,
                                                  o->arg ? required_argument : no_argument,
                                                  NULL, o->id};
                }
                if (o->short_name && ns < (int)sizeof shorts - 3) {
                    shorts[ns++] = o->short_name;
                    if (o->arg) shorts[ns++] = ':';
                }
            }
        }
        longs[nl] = (struct option){0, 0, 0, 0};
        shorts[ns] = '\0';
        opterr = 0;
        built = true;
    }
    for (;;) {
        int prev = optind, li = -1;
        int c = getopt_long(argc, argv, shorts, longs, &li);
        *arg = optarg;
        *optind_out = optind;
        if (c == -1) return -1;
        if (c == '?' || c == ':') {
            const char *bad = argv[prev] ? argv[prev] : "?";
            if (c == ':')
                line("option '%s' needs an argument", bad);
            else if (optopt && optopt < 128 && strncmp(bad, "--", 2) != 0)
                line("unknown option '-%c'", optopt);
            else
                line("unknown option '%s'", bad);
            print_usage(stderr, false);
            exit(KV_EXIT_USAGE);
        }
        /* getopt returns the character for a short option: map it to the
         * id of the table entry that declares it; an entry without help is
         * an old spelling kept for scripts, which says so once. */
        if (li >= 0 && !long_of[li]->help) deprecated(long_of[li]);
        for (const kv_option *o = the_spec->opts; li < 0 && o && o->id; o++)
            if (o->short_name && c == (unsigned char)o->short_name) {
                if (!o->help) deprecated(o);
                c = o->id;
                break;
            }
        switch (c) {
        case OPT_HELP: print_usage(stdout, true); exit(KV_EXIT_OK);
        case OPT_VERSION: print_version(); exit(KV_EXIT_OK);
        case OPT_QUIET: kv_verbosity--; continue;
        case OPT_VERBOSE: kv_verbosity++; continue;
        case OPT_PROGRESS: kv_progress_mode = 1; continue;
        case OPT_NO_PROGRESS: kv_progress_mode = 0; continue;
        default: return c;
        }
    }
}

noreturn void kv_cli_usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vline(fmt, ap, NULL);
    va_end(ap);
    print_usage(stderr, false);
    exit(KV_EXIT_USAGE);
}

/* "prog: message\n" on stderr, clearing any progress line first. */
static void vmessage(const char *fmt, va_list ap)
{
    kv_progress_done();
    vline(fmt, ap, NULL);
}

void kv_warn(const char *fmt, ...)
{
    if (kv_verbosity < 0) return;
    va_list ap;
    va_start(ap, fmt);
    vmessage(fmt, ap);
    va_end(ap);
}

void kv_note(int level, const char *fmt, ...)
{
    if (kv_verbosity < level) return;
    va_list ap;
    va_start(ap, fmt);
    vmessage(fmt, ap);
    va_end(ap);
}

noreturn void kv_die(int exit_code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vmessage(fmt, ap);
    va_end(ap);
    exit(exit_code);
}

int kv_report(kv_status st, const char *fmt, ...)
{
    va_list ap;
    kv_progress_done();
    const char *d = kv_errdetail();
    va_start(ap, fmt);
    vline(fmt, ap, d[0] ? d : kv_strerror(st));
    va_end(ap);
    return kv_status_exit(st);
}

static void sub_usage_short(const kv_cli_spec *top)
{
    fprintf(stderr, "usage: %s %s\nTry '%s --help' for more information.\n", top->name, top->synopsis, top->name);
}

int kv_cli_subcommands(const kv_cli_spec *top, const kv_cli_spec *subs, const kv_cli_sub_fn *fns, int n,
                       const char *version_extra, int argc, char **argv)
{
    kv_cli_init(top, argc, argv);
    if (argc < 2) {
        fprintf(stderr, "%s: missing subcommand\n", top->name);
        sub_usage_short(top);
        return KV_EXIT_USAGE;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "-h") || !strcmp(sub, "--help")) {
        printf("usage: %s %s\n%s\n\nSubcommands:\n", top->name, top->synopsis, top->summary);
        for (int i = 0; i < n; i++) printf("  %s %s\n      %s\n", subs[i].name, subs[i].synopsis, subs[i].summary);
        printf("\nRun '%s SUBCOMMAND --help' for its options.  %s\n"
               "Exit status: 0 ok, 64 usage, 65 bad data, 66 no input, 69 unavailable,\n"
               "70 internal, 73 cannot create output, 74 I/O error.\n",
               top->name, top->epilog ? top->epilog : "");
        return KV_EXIT_OK;
    }
    if (!strcmp(sub, "-V") || !strcmp(sub, "--version")) {
        kv_cli_version_extra = version_extra;
        const char *a;
        int oi;
        char *vargv[] = {argv[0], (char *)"--version", NULL};
        kv_cli_next(2, vargv, &a, &oi); /* prints and exits */
        return KV_EXIT_OK;
    }
    size_t tl = strlen(top->name);
    for (int i = 0; i < n; i++) {
        if (strncmp(subs[i].name, top->name, tl) || subs[i].name[tl] != ' ' || strcmp(sub, subs[i].name + tl + 1))
            continue;
        kv_cli_init(&subs[i], argc - 1, argv + 1);
        int rc = fns[i](argc - 1, argv + 1);
        if (!rc && (fflush(stdout) != 0 || ferror(stdout))) {
            kv_warn("write error on stdout");
            rc = KV_EXIT_IOERR;
        }
        return rc;
    }
    kv_warn("unknown subcommand '%s'", sub); /* escaped: argv may hold anything */
    sub_usage_short(top);
    return KV_EXIT_USAGE;
}
