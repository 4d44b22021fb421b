/*
 * kv_cli: the small front end shared by every kv-* tool (the library proper
 * never prints).  It owns the program name, warn/die, verbosity, the exit
 * code table (via kv_status_exit), TTY/NO_COLOR detection, a rate-limited
 * progress line, and a table-driven option parser that also writes --help.
 *
 * Every tool gets -h/--help, -V/--version, -q/--quiet, -v/--verbose,
 * --progress and --no-progress for free; tools declare the rest in a
 * kv_option table.
 */
#ifndef KV_CLI_H
#define KV_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdnoreturn.h>

#include "common/kv_device.h"
#include "common/kv_status.h"

#define KV_VERSION "0.1.0"

typedef struct {
    int id;                /* value kv_cli_next returns (also for the short form);
                              use >= 256 for long-only options */
    char short_name;       /* 0 if none */
    const char *long_name; /* NULL if none */
    const char *arg;       /* metavar if the option takes an argument, else NULL */
    const char *help;      /* one line; NULL: a deprecated spelling, short-only
                              or long-only (no --help line; using it warns once,
                              naming the entry of the same id that has help) */
} kv_option;

typedef struct {
    const char *name;     /* "kv-info" */
    const char *synopsis; /* "[OPTIONS] FILE|-" */
    const char *summary;  /* one line: what the tool does */
    const kv_option *opts; /* terminated by an entry with id 0 */
    const char *epilog;   /* extra help text, may be NULL */
} kv_cli_spec;

/* Process-wide front-end state (one per process, set by kv_cli_init). */
extern int kv_verbosity;     /* 0 normal, <0 quieter, >0 chattier */
extern int kv_progress_mode; /* -1 auto (stderr is a tty), 0 off, 1 on */

void kv_cli_init(const kv_cli_spec *spec, int argc, char **argv);
const char *kv_progname(void);

/*
 * Next option: returns its id and sets *arg (NULL for flags); returns -1 at
 * the end (then *optind_out is the first operand).  Handles the common
 * options itself: --help prints usage to stdout and exits 0, --version
 * likewise; an unknown option prints one line and the usage to stderr and
 * exits 64.
 */
int kv_cli_next(int argc, char **argv, const char **arg, int *optind_out);

noreturn void kv_cli_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void kv_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Message at verbosity >= level (1 = -v). */
void kv_note(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
noreturn void kv_die(int exit_code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Print "prog: what: detail-or-strerror" and return the status's exit code. */
int kv_report(kv_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Numeric option parsing; a bad value is a usage error (exit 64). */
long kv_cli_long(const char *opt, const char *s, long lo, long hi);
double kv_cli_double(const char *opt, const char *s, double lo, double hi);
/* A byte count with an optional binary suffix: 512, 64K, 2MiB, 1G, 3TB. */
uint64_t kv_cli_bytes(const char *opt, const char *s);
/* --device: cpu, cuda, auto, cuda:N or N (kv_device_parse); *ordinal (may
 * be NULL) gets the CUDA device, 0 unless named. */
kv_device kv_cli_device(const char *s, int *ordinal);

bool kv_is_tty(FILE *f);
bool kv_color_ok(FILE *f); /* tty and NO_COLOR unset */
/* True if the tool should write JSON to f: --json given or f is not a tty. */
bool kv_want_json(FILE *f, bool json_flag);
/* Refuse to write binary data to a terminal (exit 64 with a message). */
void kv_refuse_binary_tty(FILE *f, const char *what);

/* Rate-limited progress line on stderr (at most ~4 updates/s, tty only). */
void kv_progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void kv_progress_done(void);

/* Seconds since the epoch, or the value of environment variable env when it
 * is set (a fixed clock for reproducible tests; a bad value is a usage error). */
int64_t kv_cli_clock(const char *env);

/* Operands after the options: the next one (missing: a usage error naming
 * what), and the check that none is left over. */
const char *kv_cli_operand(int argc, char **argv, int *i, const char *what);
void kv_cli_no_more(int argc, char **argv, int i);

/*
 * A tool made of subcommands (kv-tree): top names the tool (its synopsis
 * and summary head --help); subs[i] is "TOOL SUB"'s spec and fns[i] runs it
 * on argv shifted by one (after kv_cli_init with that spec).  A missing or
 * unknown subcommand is a usage error (64, with the short usage); --help
 * lists the subcommands and top->epilog on stdout; --version adds
 * version_extra.  After a subcommand succeeds, a failed stdout is 74.
 */
typedef int (*kv_cli_sub_fn)(int argc, char **argv);
int kv_cli_subcommands(const kv_cli_spec *top, const kv_cli_spec *subs, const kv_cli_sub_fn *fns, int n,
                       const char *version_extra, int argc, char **argv);

/* Extra --version line from the tool (e.g. format version); may be NULL. */
extern const char *kv_cli_version_extra;

#endif
