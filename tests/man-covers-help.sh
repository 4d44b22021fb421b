#!/bin/sh
# man-covers-help.sh MAN HELP-COMMAND...: list every long option that the
# command's --help prints but the man page never mentions, and fail if there
# is one.  The bats files of each tool call it so that a new option cannot
# ship undocumented; it also checks that the page has every section and the
# full exit status table that the project's man pages promise.
set -u
man=$1
shift
help=$("$@" --help) || { echo "$* --help failed"; exit 2; }
# Man source with font escapes and backslashes gone: \-\-no\-progress -> --no-progress.
text=$(sed 's/\\f[BIRP]//g; s/\\//g' "$man")
bad=0
for o in $(printf '%s\n' "$help" | grep -oE '^ +(-[A-Za-z], )?--[a-z0-9-]+' | grep -oE -- '--[a-z0-9-]+'); do
    printf '%s\n' "$text" | grep -qE -- "(^|[^a-z0-9-])$o([^a-z0-9-]|$)" || { echo "$man lacks $o"; bad=1; }
done
for s in NAME SYNOPSIS DESCRIPTION OPTIONS 'EXIT STATUS' EXAMPLES 'SEE ALSO'; do
    grep -qE "^\.SH \"?$s" "$man" || { echo "$man lacks section $s"; bad=1; }
done
codes=$(awk '/^\.SH "?EXIT STATUS/{f=1;next} /^\.SH/{f=0} f' "$man" | sed 's/\\f[BIRP]//g')
for c in 0 64 65 66 69 70 73 74; do
    printf '%s\n' "$codes" | grep -qE "^(\.B |\.IP |\.TP )?$c( |$)" || { echo "$man EXIT STATUS lacks $c"; bad=1; }
done
exit $bad
