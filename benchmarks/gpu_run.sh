#!/usr/bin/env bash
# What one device call runs, from the repository root on the GPU machine: `bash benchmarks/gpu_run.sh STAGE [ARGS]`.
#   check               GPU tests (graphs equal eager; ragged verifies; channels between services) and the in-process bench
#                       (BATCHES= empty: the tests only)
#   services DRAFTS     PSD and SD (MODES=psd,sd,ar adds AR) through the services (two GPUs when there are:
#                       cuda-ipc and nccl, SD baselines); an 8B pair's PSD stack takes 132 s to start with its
#                       precapture, so AR rarely fits in the same call. On one GPU psd under the default
#                       OVERLAP=auto runs one merged batch: OVERLAP=always measures its two batches.
#                       EXTRA=--services-profile: profiles of a few worker calls, summed up by call_profiles.py
#                       TARGET_SHAPE=70b (32b): a larger random target, written a tensor at a time
#                       (shaped_checkpoint.py), for EXTRA="--tensor-parallel-size 4"; MODES may add sd2b and sddp
#   prefill             prefills of the 8B target: batches of 512-token prompts (BATCHES), tokens/s and TFLOP/s,
#                       and prompts of mixed lengths grouped by length against one forward (COMPILE=1: compiled;
#                       EXTRA="--profile": then where one prefill's host time goes, and where it waits for the GPU)
#   profile             one served 68m stack with worker profiles, and the same steps profiled in process
#   kvgather            ways of reading a batch's keys out of the slot KV cache
#   attention           the step attention's fused and two-matmul paths, compiled, at real steps' shapes
#   compile             steps with and without compiled layers, side by side (COMPILE_MODES), and the compiled steps
#                       profiled (PROFILE_BATCHES= empty: not profiled)
#   calls               a served load of the demo pair on the GPUs: each worker call's time outside the worker
#   stepcalls           the step calls' transport side by side (--step-calls unary and stream; ORDERS: each order
#                       once) on served loads of the demo pair (LOADS): 64 at once (CALLS_MODES: sd and ar, batches
#                       of 32) and one at a time (sd); each worker call's time outside the worker (CALLS_PROMPTS,
#                       CALLS_OUTPUT)
#   steps               the 8B verify and a draft's proposal in process: step times, host time before and during
#                       each graph's launch, the host's calls, kernels (COMPILE=1: compiled layers; PROFILE_BATCHES,
#                       PROFILE_DRAFT; EXTRA=--one-graph: a graph per step, not a chain)
#   paged               the paged KV cache served on one GPU (benchmarks/paged_bench.py; 8B- and 68M-shaped random
#                       weights, built once into /tmp/minedraft-paged-ckpt): 128 prompts of 1000-4000 tokens at once at
#                       --max-model-len 32768 (output tokens/s, peak KV blocks, preemptions), start to SERVING at 2048
#                       and 32768, 64 prompts sharing 2000 tokens with prefix caching on and off (TTFT, cached tokens),
#                       the TTFT of a fresh stack's 1st and 10th requests. QUESTIONS: some of long,connect,prefix,first
#                       (three stacks for all four); EXTRA: its flags (--requests 64, --target-kv-cache-memory 24 ...)
#   served              the demo pair served on the GPUs in psd, sd and ar (MODES): output tokens/s of 128 (PROMPTS) requests
#                       (64 at once, batches of 32, 64-token prompts, 96 tokens out); host-bound, so it shows what a
#                       step costs the host
#   grammar             structured output's served cost (the issue's goal: within 10%): an 8B-shaped target and a
#                       68M draft (random weights, the demo tokenizer) on one GPU, psd and sd (MODES), each stack
#                       serving the same load unconstrained and under a JSON schema in alternating rounds (ROUNDS):
#                       tokens/s of each, accepted drafts, CPU ms a token per service (BATCH, PROMPTS)
#   tetris              TETRIS served (8B-shaped target, 68M draft, one GPU or two): plain psd and sd, then psd
#                       --tetris with E = 2 and 4 (TETRIS_EXTRAS), at batches 32 and 64 (TETRIS_BATCHES), all at a
#                       synthetic acceptance of 0.9 or 0.3 by row that the draft's scores predict (ROW_ACCEPTANCE;
#                       a single rate, 0.6, is the control where selection cannot help; RATE_BY=step: each row's rate
#                       drawn anew each step, not its request's; TETRIS_PROMPTS: requests a
#                       stack, 4 x batch); output tokens/s of each;
#                       first one verify step ragged against padded and uniform (ragged_verify_bench.py, 8 layers)
#   eagle               drafts that read the target (benchmarks/eagle_bench.py): an 8B-shaped target (synthetic
#                       acceptance ACCEPTANCE, 0.7) with a random EAGLE-3 head (eagle_head_checkpoint.py, draft vocab
#                       32000), with the 68M draft and with n-gram (on the CPU): proposal, verify and channel times and
#                       served SD (MODES: sd,psd) and AR at BATCHES (1,8,32,64; n-gram: NGRAM_BATCHES 8,32); first the
#                       head's proposal alone in process (eagle_proposal_bench.py), graphed and --eager
#   pending             what is built and not yet measured, in one call (the EAGLE-3 head served at batches 1-64)
#   pending-served      TETRIS at batch 64 where acceptance varies by token (the call after pending, warm)
#   ragged              one ragged verify step against uniform at each of the ragged kernel's row caps (ROWS)
#   ab STAGE [ARGS]     before and after in one call: STAGE on a copy of the tree with the files kept in .old/ (the
#                       same paths) put over it, output in $OUT/old, then STAGE on this tree (AB_ORDER=new-first:
#                       this tree first; abba: old, new, new, old, the second pair in $OUT/new2 and $OUT/old2;
#                       AB_KEEP="benchmarks/gpu_run.sh benchmarks/prefill_bench.py": these files of this tree in both)
#   trees STAGE [ARGS]  STAGE on several commits' code in one call, to find which commit a figure moved at: TREES
#                       lists them ("607e410 2e85a32 HEAD"), each packed here first (`bash benchmarks/gpu_run.sh pack
#                       COMMIT...` writes .trees/COMMIT.tar; carry .trees). It runs them in order, then back (a b c c
#                       b a), so that a slower host late in the call weighs on every tree alike; one file out
#   pack COMMIT...      (here, not on the device) .trees/COMMIT.tar: a commit's code for `trees`
# Output goes to $OUT/STAGE.tgz (logs, JSON and plots in one file: the device tool brings back few files).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)  # this tree's benchmarks, which `trees` runs on other trees' code
if [ "${1:-}" = pack ]; then
    shift
    mkdir -p .trees
    for commit in "$@"; do  # (the demo pair is the same in every tree: `trees` copies this one's)
        paths=$(git ls-tree --name-only "$commit" -- minedraft minedraft_app target_service draft_service coordinator \
            protos benchmarks pyproject.toml)  # (minedraft_app: from 2026-12-06)
        git archive -o ".trees/$commit.tar" "$commit" $paths ':(exclude)minedraft/demo_models' || exit 1
    done
    exit 0
fi
OUT=${OUT:-out/gpu}
mkdir -p "$OUT/run"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD  # this tree's packages: the GPU machine runs them uninstalled
# grpcio-health-checking and grpcio-reflection (carried as wheels in .whl/) are missing on the GPU machine.
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=$PWD:/tmp/site
fi
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
DRAFT_DEVICE=${DRAFT_DEVICE:-cuda:$((GPUS - 1))}
TARGET_DEVICE=${TARGET_DEVICE:-cuda:0}
stage=${1:-check}
case $stage in
ab)
    shift
    [ -d .old ] || { echo "ab: put the files of the version to compare against in .old/" >&2; exit 2; }
    rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old && cp -r .old/. /tmp/old/ || exit 1
    for keep in ${AB_KEEP:-}; do cp "$keep" "/tmp/old/$keep" || exit 1; done  # this tree's scripts on the old code
    # A stage the old tree's script lacks runs as this one's (its commands still run the old tree's code).
    grep -q "^$1)" /tmp/old/benchmarks/gpu_run.sh || cp benchmarks/gpu_run.sh /tmp/old/benchmarks/gpu_run.sh
    # The half that runs second has met a slower host (5-20% on host-bound steps): AB_ORDER=new-first swaps them,
    # abba runs old, new, new again (in $OUT/new2), old again (in $OUT/old2), for a ratio free of the order.
    case ${AB_ORDER:-old-first} in
    new-first)
        bash benchmarks/gpu_run.sh "$@"
        (cd /tmp/old && OUT=$OUT/old bash benchmarks/gpu_run.sh "$@")
        ;;
    abba)
        (cd /tmp/old && OUT=$OUT/old bash benchmarks/gpu_run.sh "$@")
        bash benchmarks/gpu_run.sh "$@"
        OUT=$OUT/new2 bash benchmarks/gpu_run.sh "$@"
        (cd /tmp/old && OUT=$OUT/old2 bash benchmarks/gpu_run.sh "$@")
        ;;
    *)
        (cd /tmp/old && OUT=$OUT/old bash benchmarks/gpu_run.sh "$@")
        bash benchmarks/gpu_run.sh "$@"
        ;;
    esac
    exit
    ;;
trees)
    shift
    [ -n "${TREES:-}" ] || { echo "trees: name the commits in TREES (packed into .trees/ first)" >&2; exit 2; }
    order="$TREES $(echo "$TREES" | tr ' ' '\n' | tac | tr '\n' ' ')"
    declare -A runs
    mkdir -p "$OUT/trees" && out=$(cd "$OUT/trees" && pwd)
    for commit in $order; do
        [ -f ".trees/$commit.tar" ] || { echo "trees: no .trees/$commit.tar (bash benchmarks/gpu_run.sh pack)" >&2; exit 2; }
        runs[$commit]=$(( ${runs[$commit]:-0} + 1 ))
        name=${commit}_${runs[$commit]}
        tree=/tmp/trees/$commit
        if [ ! -d "$tree" ]; then
            mkdir -p "$tree" && tar -xf ".trees/$commit.tar" -C "$tree" && cp -r minedraft/demo_models "$tree/minedraft/" \
                && { [ ! -d .whl ] || cp -r .whl "$tree/"; } || exit 1
        fi
        echo "== $name"
        (cd "$tree" && OUT="$out/$name" bash "$HERE/gpu_run.sh" "$@") 2>&1 | tee "$out/$name.txt"
    done
    python3 "$HERE/tree_figures.py" "$OUT/trees" $TREES
    tar czf "$OUT/trees.tgz" -C "$OUT" trees && rm -rf "$OUT/trees" "$OUT/run"
    exit 0
    ;;
check)
    nvidia-smi topo -m > "$OUT/run/topology.txt" 2>&1
    timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py \
        tests/test_kv_cache.py -k "decode or table_writer" 2>&1 | tee "$OUT/run/test_decode_attention.log" | tail -3
    # Its compiled steps come last: their compiles took past 120 s on a fresh machine.
    timeout -k 10 240 python3 tests/test_cuda_graphs.py 2>&1 | tee "$OUT/run/test_cuda_graphs.log" \
        | grep -vE "Warn|warn|^$|softmax|important use|split the reduction" | tail -8
    # TETRIS's ragged verify equals the padded one (paged kernels, graphs against eager, shapes precaptured).
    timeout -k 10 240 python3 tests/test_gpu_ragged.py 2>&1 | tee "$OUT/run/test_gpu_ragged.log" | tail -5
    # The EAGLE head's draft chains replayed from graphs equal eager ones.
    timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_eagle.py 2>&1 | tee "$OUT/run/test_gpu_eagle.log" | tail -3
    timeout -k 10 240 python3 -X faulthandler -m pytest -q -x -p no:cacheprovider --basetemp "$OUT/run/pytest" tests/test_gpu_channels.py 2>&1 \
        | tee "$OUT/run/test_gpu_channels.log" | tail -5
    # The reverse direction's cost a step (batch 64, 5 positions, 4096-wide bf16: 2.6 MB); nccl on two GPUs with CuPy.
    for channel in cuda-ipc $( [ "$(nvidia-smi -L | wc -l)" -gt 1 ] && python3 -c "import cupy" 2>/dev/null && echo nccl ); do
        timeout -k 10 120 python3 benchmarks/channel_bench.py --channel "$channel" 2>&1 | tail -1 | tee -a "$OUT/run/channel_bench.log"
    done
    [ "${BATCHES-1,8,32,64}" = "" ] && { tar czf "$OUT/$stage.tgz" -C "$OUT" run && rm -rf "$OUT/run"; exit 0; }  # tests only
    timeout -s USR1 -k 20 ${BENCH_SECONDS:-300} python3 -X faulthandler benchmarks/step_bench.py --target-device "$TARGET_DEVICE" \
        --draft-device "$DRAFT_DEVICE" --drafts 68m,1b --batch-sizes "${BATCHES:-1,8,32,64}" --ks "${KS:-2,4,6}" \
        --in-process-psd --out "$OUT/run/inproc" > "$OUT/run/inproc.log" 2>&1
    grep -A40 "^synthetic acceptance" "$OUT/run/inproc.log"
    ;;
services)
    timeout -s USR1 -k 30 ${BENCH_SECONDS:-540} python3 -X faulthandler benchmarks/services_bench.py \
        --target-device "$TARGET_DEVICE" --draft-device "$DRAFT_DEVICE" --services "${2:-68m}" \
        --services-channels "${CHANNELS:-cuda-ipc,nccl}" --services-overlap "${OVERLAP:-auto}" \
        --services-speculation "${SPECULATION:-auto}" \
        --services-modes "${MODES:-psd,sd}" --services-timeout "${SERVICES_TIMEOUT:-330}" \
        ${TARGET_SHAPE:+--target-shape $TARGET_SHAPE} ${EXTRA:-} \
        --out "$OUT/run/services" > "$OUT/run/services.log" 2>&1
    grep -E "^\[services|: \{'psd|timed out|Error|services up" "$OUT/run/services.log" | tail -30
    grep -E " trace: " "$OUT/run/services.log" | cut -c1-600  # call, compute, queue and worker-handler times
    grep -E "step shapes" "$OUT"/run/services/logs_*/*.log | cut -c1-220 | head -20
    grep -c "captured a CUDA graph" "$OUT"/run/services/logs_*/*.log
    python3 -c "import json, sys; s = json.load(open(sys.argv[1]))['summary']; print(json.dumps(s.get('two_gpu'), indent=1))" \
        "$OUT/run/services/gpu_bench.json"
    for profiles in "$OUT"/run/services/profiles_*.tar.gz; do  # EXTRA=--services-profile: the calls' host and GPU time
        [ -f "$profiles" ] && python3 benchmarks/call_profiles.py "$profiles" --top 8
    done
    ;;
prefill)
    timeout -k 10 ${BENCH_SECONDS:-200} python3 benchmarks/prefill_bench.py ${COMPILE:+--compile} \
        --batches "${BATCHES:-1,8,16,24,32,39,48,64}" ${EXTRA:-} 2>&1 | tee "$OUT/run/prefill.txt"
    ;;
profile)
    timeout -s USR1 -k 30 ${BENCH_SECONDS:-400} python3 -X faulthandler benchmarks/services_bench.py \
        --services 68m:timesliced --services-overlap auto --services-profile --services-prompts 256 \
        ${EXTRA:-} --out "$OUT/run/services" > "$OUT/run/services.log" 2>&1
    grep -E "^\[services|trace:|steady state" "$OUT/run/services.log" | tail -12
    timeout -k 10 ${PROFILE_SECONDS:-150} python3 benchmarks/profile_step.py --trace-dir "$OUT/run/profile_step" \
        > "$OUT/run/profile_step.txt" 2>&1
    tail -30 "$OUT/run/profile_step.txt"
    ;;
compile)
    timeout -s USR1 -k 20 ${BENCH_SECONDS:-330} python3 -X faulthandler benchmarks/step_bench.py --target-device "$TARGET_DEVICE" \
        --draft-device "$DRAFT_DEVICE" --drafts "${DRAFTS:-68m,1b}" --batch-sizes "${BATCHES:-1,8,16,32}" \
        --ks "${KS:-4}" --compile-modes "${COMPILE_MODES:-off,on}" --out "$OUT/run/compile" > "$OUT/run/compile.log" 2>&1
    grep -E "warmed up|compile (on|off): measuring" "$OUT/run/compile.log" | cut -c1-160
    python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(r['draft'], 'compiled' if r['compiled'] else 'uncompiled', 'B=%d' % r['batch'], 'T_d %.2f T_v %.2f floor_v %.2f AR %.2f PSD/SD %.2f ideal %.2f' % (
        r['t_draft_ms'], r['t_verify_ms'], r['verify_floor_ms'], r['t_ar_ms'], r['psd_over_sd'], r['ideal']))" \
        "$OUT/run/compile/gpu_bench.json"
    [ "${PROFILE_BATCHES-1,8}" = "" ] && { tar czf "$OUT/$stage.tgz" -C "$OUT" run && rm -rf "$OUT/run"; exit 0; }
    timeout -k 10 ${PROFILE_SECONDS:-150} python3 benchmarks/profile_step.py --compile --batches "${PROFILE_BATCHES:-1,8}" \
        --draft "${PROFILE_DRAFT:-68m}" \
        > "$OUT/run/profile_step_compiled.txt" 2>&1
    grep -E "kernels|ms:|launch" "$OUT/run/profile_step_compiled.txt" | head -40
    ;;
calls)
    timeout -k 10 ${BENCH_SECONDS:-150} python3 -m minedraft_app bench --modes "${MODES:-sd,ar}" --target-device "$TARGET_DEVICE" \
        --draft-device "$DRAFT_DEVICE" --max-batch-size 32 --num-prompts 64 --prompt-len 64 --output-len 96 \
        --no-progress --step-trace-dir "$OUT/run/traces" > "$OUT/run/bench.log" 2>&1
    tail -8 "$OUT/run/bench.log"
    python3 benchmarks/call_overhead.py "$OUT/run/traces"
    ;;
stepcalls)
    for order in ${ORDERS:-unary,stream stream,unary}; do
        for calls in ${order//,/ }; do
            for load in ${LOADS:-c64 c1}; do
                name=${calls}_${load}_${order%%,*}_first
                if [ $load = c64 ]; then size="--modes ${CALLS_MODES:-sd,ar} --num-prompts ${CALLS_PROMPTS:-256} --concurrency 64"
                else size="--modes sd --num-prompts 16 --concurrency 1"; fi
                MINEDRAFT_STEP_CALLS=$calls timeout -k 10 ${BENCH_SECONDS:-100} python3 -m minedraft_app bench \
                    --target-device "$TARGET_DEVICE" --draft-device "$DRAFT_DEVICE" --max-batch-size 32 \
                    --prompt-len 64 --output-len ${CALLS_OUTPUT:-128} $size --no-progress \
                    --step-trace-dir "$OUT/run/traces_$name" > "$OUT/run/bench_$name.log" 2>&1
                echo "== $name"; grep -E "^(sd|ar) +[0-9]" "$OUT/run/bench_$name.log"
                python3 benchmarks/call_overhead.py "$OUT/run/traces_$name" | grep -E "B=(1|32|64) "
            done
        done
    done
    ;;
steps)
    timeout -k 10 ${PROFILE_SECONDS:-240} python3 benchmarks/profile_step.py ${COMPILE:+--compile} \
        --batches "${PROFILE_BATCHES:-1,16}" --draft "${PROFILE_DRAFT:-1b}" --trace-dir "" --kernel-tables "$OUT/run/kernels" ${EXTRA:-} > "$OUT/run/steps.txt" 2>&1
    grep -E "ms:|phases|launch|kernels|on the GPU" "$OUT/run/steps.txt" | cut -c1-200
    grep -E "host path" "$OUT/run/steps.txt"
    grep -A12 "host calls" "$OUT/run/steps.txt" | cut -c1-140
    ;;
attention)
    timeout -k 10 ${BENCH_SECONDS:-300} python3 benchmarks/attention_bench.py ${EXTRA:-} 2>&1 | tee "$OUT/run/attention.txt"
    ;;
kvgather)
    python3 benchmarks/kv_gather_bench.py 2>&1 | tee "$OUT/run/kv_gather.txt"
    python3 benchmarks/kv_gather_bench.py --batch 8 2>&1 | tee -a "$OUT/run/kv_gather.txt"
    ;;
served)
    app=$([ -d minedraft_app ] && echo minedraft_app || echo minedraft)  # (a tree before 2026-12-06: minedraft)
    models=""  # the demo pair; SHAPED=68m: the 8B-shaped target and that draft (random weights, ACCEPTANCE 0.7)
    if [ -n "${SHAPED:-}" ]; then
        python3 "$HERE/shaped_checkpoint.py" 8b /tmp/ckpt/8b --device "$TARGET_DEVICE" --context 2048 || exit 1
        python3 "$HERE/shaped_checkpoint.py" "$SHAPED" "/tmp/ckpt/$SHAPED" --device "$TARGET_DEVICE" --context 2048 || exit 1
        models="--target /tmp/ckpt/8b --draft /tmp/ckpt/$SHAPED --synthetic-acceptance ${ACCEPTANCE:-0.7}"
    fi
    timeout -k 10 ${BENCH_SECONDS:-140} python3 -m $app bench $models --modes "${MODES:-psd,sd,ar}" --target-device "$TARGET_DEVICE" \
        --draft-device "$DRAFT_DEVICE" --max-batch-size 32 --num-prompts "${PROMPTS:-128}" --concurrency 64 --prompt-len 64 \
        --output-len 96 ${SPECULATION:+--speculation $SPECULATION} --no-progress --json-out "$OUT/run/served.json" \
        --step-trace-dir "$OUT/run/traces" > "$OUT/run/served.log" 2>&1
    grep -E "^(psd|sd|ar) +[0-9]|ratio" "$OUT/run/served.log"
    python3 "$HERE/call_overhead.py" "$OUT/run/traces" | grep -E "B=(1|2|32|64) "  # each call's worker time and the rest
    ;;
paged)
    # 500 s, and 30 more to stop its stack on the way out: the stage fits a 560 s call with the set-up and the tar.
    timeout -k 30 ${BENCH_SECONDS:-500} python3 -X faulthandler benchmarks/paged_bench.py --device "$TARGET_DEVICE" \
        --questions "${QUESTIONS:-long,connect,prefix,first}" ${EXTRA:-} --out "$OUT/run/paged" \
        > "$OUT/run/paged.log" 2>&1
    grep -E "^\[|checkpoint|Error" "$OUT/run/paged.log" | cut -c1-220 | tail -30
    grep -E "^(summary|total)" "$OUT/run/paged.log"
    ;;
grammar)
    python3 benchmarks/shaped_checkpoint.py 8b /tmp/ckpt/8b --device "$TARGET_DEVICE" --context 2048 || exit 1
    python3 benchmarks/shaped_checkpoint.py 68m /tmp/ckpt/68m --device "$TARGET_DEVICE" --context 2048 || exit 1
    timeout -k 30 ${BENCH_SECONDS:-420} python3 benchmarks/grammar_served_bench.py --modes "${MODES:-psd,sd}" \
        --target /tmp/ckpt/8b --draft /tmp/ckpt/68m --target-device "$TARGET_DEVICE" --draft-device "$DRAFT_DEVICE" \
        --max-batch-size "${BATCH:-8}" --num-prompts "${PROMPTS:-32}" --prompt-len 64 --output-len 96 \
        --rounds "${ROUNDS:-2}" --no-progress ${EXTRA:-} > "$OUT/run/grammar.log" 2>&1
    grep -E "^(psd|sd):|CPU ms|errors|Error|\{" "$OUT/run/grammar.log" | cut -c1-400
    ;;
deterministic)
    # --deterministic: the kernels' and the services' tests (ar, sd, psd bit-identical in bf16) and
    # test_cuda_graphs.py under the flag (TEST_SECONDS=0: none), then the matmul's candidate configs (invariance, time against torch.mm; EXTRA=--no-sweep: skipped) and
    # the step cost, plain against the flag in the default config and in the best candidate (BENCH_SECONDS=0: none).
    if [ "${TEST_SECONDS:-300}" != 0 ]; then
        timeout -k 10 ${TEST_SECONDS:-300} python3 -m pytest -q -x -p no:cacheprovider --basetemp "$OUT/run/pytest" \
            tests/test_gpu_deterministic.py 2>&1 | tee "$OUT/run/test_gpu_deterministic.log" | tail -5
        MINEDRAFT_TEST_DETERMINISTIC=1 timeout -k 10 ${TEST_SECONDS:-300} python3 -m pytest -q -p no:cacheprovider \
            --basetemp "$OUT/run/pytest-graphs" tests/test_cuda_graphs.py 2>&1 \
            | tee "$OUT/run/test_cuda_graphs_deterministic.log" | tail -5  # (graphs equal eager under the flag)
    fi
    if [ "${BENCH_SECONDS:-360}" != 0 ]; then
        timeout -k 10 ${BENCH_SECONDS:-360} python3 benchmarks/deterministic_bench.py --device "$TARGET_DEVICE" \
            --shape "${SHAPE:-8b}" --batches "${BATCHES:-8,64}" ${EXTRA:-} 2>&1 \
            | tee "$OUT/run/deterministic_bench.txt" | grep -vE "^(WARNING|INFO)" | tail -75
    fi
    ;;
deterministic-served)
    # Served throughput with and without --deterministic (8B-shaped target, 68M draft): the issue's cost goal.
    app=$([ -d minedraft_app ] && echo minedraft_app || echo minedraft)
    python3 benchmarks/shaped_checkpoint.py 8b /tmp/ckpt/8b --device "$TARGET_DEVICE" --context 2048 || exit 1
    python3 benchmarks/shaped_checkpoint.py 68m /tmp/ckpt/68m --device "$TARGET_DEVICE" --context 2048 || exit 1
    for flag in "" --deterministic; do
        for batch in ${SERVED_BATCHES:-8 64}; do
            timeout -k 10 ${BENCH_SECONDS:-120} python3 -m $app bench --modes "${MODES:-psd,ar}" $flag \
                --target /tmp/ckpt/8b --draft /tmp/ckpt/68m ${EXTRA:-} --target-device "$TARGET_DEVICE" --draft-device "$DRAFT_DEVICE" --max-batch-size $batch \
                --num-prompts $((batch * 2)) --concurrency $batch --prompt-len 64 --output-len 96 --no-progress \
                > "$OUT/run/served_${batch}${flag}.log" 2>&1
            echo "== batch $batch ${flag:-plain}"; grep -E "^(psd|sd|ar) +[0-9]" "$OUT/run/served_${batch}${flag}.log"
        done
    done
    ;;
tetris)
    # Served TETRIS against plain psd and sd at the same concurrency (design section 14): 4 stacks a batch (psd, sd,
    # psd E=2, psd E=4), each BENCH_SECONDS at most. Graphs are captured at first use, not at the connect
    # (PRECAPTURE=on to precapture: ~130 s more a stack), so that 8 stacks fit ~9 min; TETRIS_BATCHES=32 for half.
    # WARMUP requests (4 a slot) go first, unmeasured: a ragged verify's graphs are keyed by its tokens, captured there.
    app=$([ -d minedraft_app ] && echo minedraft_app || echo minedraft)
    python3 benchmarks/shaped_checkpoint.py 8b /tmp/ckpt/8b --device "$TARGET_DEVICE" --context 2048 || exit 1
    python3 benchmarks/shaped_checkpoint.py 68m /tmp/ckpt/68m --device "$TARGET_DEVICE" --context 2048 || exit 1
    # One verify step, ragged against padded and uniform (8 layers of the 8B's shape, bf16, graphs)
    for batch in $([ "${RAGGED_BENCH:-1}" = 1 ] && echo ${TETRIS_BATCHES:-32 64}); do  # (RAGGED_BENCH=0: served only)
        timeout -k 10 300 python3 benchmarks/ragged_verify_bench.py --device "$TARGET_DEVICE" --dtype bfloat16 \
            --hidden 4096 --head-dim 128 --layers 8 --vocab 128256 --batch $batch --prompt 512 --kv-cache-gib 4 2>&1 | tee -a "$OUT/run/ragged_bench.log"
    done
    for batch in ${TETRIS_BATCHES:-32 64}; do
        runs="plain"
        for extra in ${TETRIS_EXTRAS:-2 4}; do runs="$runs e$extra"; done
        for run in $runs; do
            case $run in
            plain) flags="--modes ${PLAIN_MODES:-psd,sd}" ;;
            *) flags="--modes psd --tetris --tetris-extra-proposals ${run#e}" ;;
            esac
            timeout -k 10 ${BENCH_SECONDS:-100} python3 -m $app bench $flags --speculation always \
                --synthetic-row-acceptance "${ROW_ACCEPTANCE:-0.9,0.3}" --synthetic-rate-by "${RATE_BY:-request}" --target /tmp/ckpt/8b --draft /tmp/ckpt/68m \
                --precapture-graphs ${PRECAPTURE:-off} ${EXTRA:-} --target-device "$TARGET_DEVICE" \
                --draft-device "$DRAFT_DEVICE" --max-batch-size $batch --num-prompts ${TETRIS_PROMPTS:-$((batch * 4))} \
                --num-warmup ${WARMUP:-$((batch * 4))} --concurrency $((batch * 2)) --prompt-len 64 --output-len 96 --no-progress \
                --log-dir "$OUT/run/tetris_${batch}_${run}" > "$OUT/run/tetris_${batch}_${run}.log" 2>&1  # (services' logs: graphs)
            echo "== batch $batch $run"; grep -E "^(psd|sd|ar) +[0-9]" "$OUT/run/tetris_${batch}_${run}.log"
        done
    done
    ;;
ragged)
    # One ragged verify step against uniform (8 layers of the 8B's shape, bf16, graphs) at each of the ragged
    # kernel's row caps in ROWS (none: one program takes all of a K/V head's folded queries; decode_attention.RAGGED_ROWS)
    [ "${RAGGED_TESTS:-1}" = 0 ] || timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider \
        tests/test_decode_attention.py tests/test_gpu_ragged.py 2>&1 | tail -1
    for rows in ${ROWS:-none 32 16}; do
        echo "== RAGGED_ROWS $rows"
        timeout -k 10 ${BENCH_SECONDS:-100} python3 benchmarks/ragged_verify_bench.py --device "$TARGET_DEVICE" \
            --dtype bfloat16 --hidden 4096 --head-dim 128 --layers 8 --vocab 128256 --batch "${BATCH:-32}" --prompt 512 --kv-cache-gib 4 \
            --repeats "${REPEATS:-20}" $([ "$rows" = none ] || echo "--ragged-rows $rows") ${EXTRA:-} 2>&1 \
            | grep -v Warning | tee -a "$OUT/run/ragged_rows.log" | grep -E "positions|/"
    done
    ;;
pending)
    # What is built and not yet measured, most wanted first, in one call of ~6 min: the EAGLE-3 head's served table
    # since its proposal is one graph (a20076b), at every batch of the issue's goal and beside the 68M draft.
    PROPOSAL=0 DRAFTERS=eagle3,draft MODES=sd BATCHES=1,8,32,64 BENCH_SECONDS=480 timeout -k 10 520 bash "$0" eagle
    ;;
pending-served)
    # TETRIS at batch 64 where acceptance varies token by token (the call after pending, warm).
    OUT=$OUT/tetris RATE_BY=step RAGGED_BENCH=0 PLAIN_MODES=psd TETRIS_BATCHES=64 TETRIS_EXTRAS="2 4" \
        TETRIS_PROMPTS=512 BENCH_SECONDS=100 timeout -k 10 520 bash "$0" tetris
    ;;
eagle)
    python3 benchmarks/shaped_checkpoint.py 8b /tmp/ckpt/8b --device "$TARGET_DEVICE" --context 2048 || exit 1
    python3 benchmarks/shaped_checkpoint.py 68m /tmp/ckpt/68m --device "$TARGET_DEVICE" --context 2048 || exit 1
    python3 benchmarks/eagle_head_checkpoint.py /tmp/ckpt/8b /tmp/ckpt/8b-eagle3 --device "$TARGET_DEVICE" || exit 1
    if [ "${PROPOSAL:-1}" = 1 ]; then  # The proposal alone, in process (random target states), graphed and eager.
        timeout -k 10 120 python3 benchmarks/eagle_proposal_bench.py --target /tmp/ckpt/8b --head /tmp/ckpt/8b-eagle3 \
            --device "$TARGET_DEVICE" --dtype bfloat16 --batches "${BATCHES:-1,8,32,64}" 2>&1 | tee "$OUT/run/eagle_proposal.txt"
        timeout -k 10 120 python3 benchmarks/eagle_proposal_bench.py --target /tmp/ckpt/8b --head /tmp/ckpt/8b-eagle3 \
            --eager --device "$TARGET_DEVICE" --dtype bfloat16 --batches "${BATCHES:-1,8,32,64}" 2>&1 \
            | tee "$OUT/run/eagle_proposal_eager.txt"
    fi
    if [ "${SERVED:-1}" = 1 ]; then  # (SERVED=0: the proposal alone)
        timeout -k 60 ${BENCH_SECONDS:-420} python3 benchmarks/eagle_bench.py --target /tmp/ckpt/8b \
            --head /tmp/ckpt/8b-eagle3 --draft /tmp/ckpt/68m --device "$TARGET_DEVICE" --batches "${BATCHES:-1,8,32,64}" \
            --ngram-batches "${NGRAM_BATCHES:-8,32}" --modes "${MODES:-sd,psd}" --drafters "${DRAFTERS:-eagle3,draft,ngram}" \
            --acceptance "${ACCEPTANCE:-0.7}" ${EXTRA:-} --out "$OUT/run/eagle" > "$OUT/run/eagle.log" 2>&1
        grep -E "x AR|Error|did not start" "$OUT/run/eagle.log"
    fi
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
# A stack whose bench ran past its time leaves its services running, holding GPU memory: the next stage's ran out
# of it.
pkill -9 -f "[m]inedraft(_app)?(\.cli)? (bench|target|draft|coordinator)" 2>/dev/null
tar czf "$OUT/$stage.tgz" -C "$OUT" run && rm -rf "$OUT/run"  # stages can run one after another in one call
