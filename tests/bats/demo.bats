#!/usr/bin/env bats
# `make demo` (tests/demo.sh) on the bundled real models, run as the README
# tells a new user to: every step must run to its end.  A change to a tool's
# JSON that the demo's printers read (a field that became null, a renamed
# key) once broke step 3 with a Python traceback that no other test saw.
load helper

# bats-asan runs the suite again under the sanitizers; the demo is the
# plain tools' job (it takes seconds there, minutes under ASan).
# bats test_tags=slow
@test "make demo's script runs every step to the end on the bundled models" {
    run --separate-stderr env KV_BIN="$BIN" sh "$ROOT/tests/demo.sh"
    [ "$status" -eq 0 ] || { echo "exit $status; stderr: $stderr"; echo "$output" | tail -n 20; return 1; }
    for n in 1 2 3 4 5 6 7 8; do
        [[ "$output" == *"== $n. "* ]] || { echo "step $n missing"; return 1; }
    done
    [[ "$output" == *"== Done =="* ]]
    [[ "$output" != *"Traceback"* ]]
    # step 3's table: the chosen deployment meets its byte budget
    [[ "$output" == *"budget met: True"* ]]
}
