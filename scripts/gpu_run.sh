#!/usr/bin/env bash
# Run the GPU benchmarks on a CUDA machine whose python3 already has torch, transformers, triton,
# scipy, safetensors and accelerate (no datasets / lm-eval needed): the package is put on PYTHONPATH
# with kernels/ and calib/ mapped as on install. Each named step appends or writes its
# scripts/results/*.json, copied to $OUT (default /tmp/gpu_out) as soon as it ends.
#
#   bash scripts/gpu_run.sh                    # what issue 24 has not measured, in one device call (at most 600 s):
#                                              # sparse_mma sparse_gemm kernel targets, then `fill`: the queued
#                                              # steps (e2e targets, next1 … next7, in order) that fit in what is
#                                              # left of BUDGET_S
#   BUDGET_S=570 (default; 0: none)            # the call's seconds: a step starts only with at least 15 s left and runs
#                                              # at most what is left (its file keeps what it measured); a `fill` step
#                                              # starts only when its whole limit fits
#   bash scripts/gpu_run.sh pipeline           # the commands users type on CUDA: prune (every recipe) / export /
#                                              # load / generate / eval ppl / finetune / dst, a random GQA LLaMA-shaped model
#                                              # saved locally (gpu_pipeline.json)
#   bash scripts/gpu_run.sh fast_launch        # kernels/launch.py's fast launches against Triton's dispatch: outputs
#                                              # bit for bit and the host's µs per call both ways (fast_launch_cuda.json)
#   bash scripts/gpu_run.sh host               # the host's µs per eager call, real launches: nn.Linear, RMSNorm, a
#                                              # bare Triton launch, nm_decode, SparseLinear, a stacked member, the
#                                              # fused norm (bench_host_overhead_cuda.json)
#   bash scripts/gpu_run.sh gather             # a mapped input's three gathers (index_select, Triton columns, Triton
#                                              # rows staged in shared memory) alone, and auto / auto_tiled with the
#                                              # map at 1-2048 tokens on the three input widths, with scratch (gathered
#                                              # input) against scratch_mapped (the map in the weight written to the
#                                              # scratch, no gather) on prompts (bench_gather.json)
#                                              # Put nothing else under $OUT: the device tool returns a limited
#                                              # number of files, and past it none of the named ones come back
#   bash scripts/gpu_run.sh stage_cost         # pruning stages' cost on LLaMA-2-7B-shaped blocks (a second call:
#                                              # one device call runs at most 600 s)
#   bash scripts/gpu_run.sh tune_tiles         # decode_plan's and gemm_plan's tiles: both decode kernels’
#                                              # tiles and pipeline depths, every GEMM tile against the cost
#                                              # model's pick (tune_select + tune_dot + tune_gemm, its own call)
#   bash scripts/gpu_run.sh tune_decode kernel kernel_fused e2e   # the decode kernels' tiles and split-K on
#                                              # the gathered input, timed as bench_kernel times (rotating copies,
#                                              # CUDA graphs); kernel_fused: q/k/v and gate/up as one layer each
#   bash scripts/gpu_run.sh tune_bandwidth     # the select (1-2 tokens) and weight-as-A (2-16) decodes' tiles,
#                                              # pipeline depths (to 6) and split-K (2, 4 programs per SM) on a GPU
#                                              # with more bandwidth per SM than the H100 the tiles were tuned on
#                                              # (an H200: same SMs and clocks, 1.4x the HBM bandwidth)
#   bash scripts/gpu_run.sh tune_swap          # the weight-as-A-operand decode (2–64 tokens) and GEMM against the
#                                              # others' tiles, and the in-kernel map's tiles at 1 token
#   bash scripts/gpu_run.sh tune_tall          # the weight-as-A GEMM on 128 weight rows per program (GEMM_TILES_SWAP_TALL)
#                                              # against its 64-row tiles, every tile at 64/512/2048 tokens (tune_tall.json)
#   bash scripts/gpu_run.sh sparse_mma         # the decode on the sparse tensor cores (mma.sp) checked against a dense
#                                              # bf16 matmul and timed against cuBLAS, 4 shapes, 1-64 tokens, in
#                                              # cuSPARSELt's layout, with no map and (1-16) reading a random
#                                              # one itself, each also with the tall plan's CTAs from 4 tokens
#                                              # (through a map from 1), the map's also without its L2 prefetch
#                                              # and read inline by each B load (tune_sparse_mma.json)
#   bash scripts/gpu_run.sh sparse_gemm        # the prompt GEMM on the sparse tensor cores, every tile of GEMM_TILES
#                                              # with 3 and 4 stages, checked against a dense bf16 matmul and timed
#                                              # against cuBLAS at 64, 512 and 2048 tokens on three shapes, in
#                                              # cuSPARSELt's layout (tune_sparse_gemm.json)
#   bash scripts/gpu_run.sh mma_ceiling        # the tensor cores' rate through mma.sp, mma, and on Hopper wgmma.sp and
#                                              # wgmma, MMAs alone (mma_ceiling.json; a process of its own: a wgmma
#                                              # that faulted would take only this step with it)
#   bash scripts/gpu_run.sh tune_sparse_mma_bounds # the decode with its registers capped to hold 0 (none), 5 or 6
#                                              # CTAs an SM, at 1 and 16 tokens, with and without a map
#                                              # (tune_sparse_mma_bounds.json)
#   bash scripts/gpu_run.sh tune_sparse_mma    # its tiles: warps and CTAs along K, m-tiles per warp, 2 or 3 steps in
#                                              # registers, at 1, 16 and 64 tokens on three shapes
#                                              # (tune_sparse_mma_sweep.json); then row groups of warps (rw) and K
#                                              # groups against the tall plan's pick at 4-64 tokens
#                                              # (tune_sparse_mma_rows.json)
#   bash scripts/gpu_run.sh profile_sparse_mma # Nsight Compute on the sparse-MMA decode at 1 and 16 tokens, 11008x4096,
#                                              # and against its tall plan at 16 (11008x4096) and 64 tokens (4096x4096),
#                                              # and the prompt GEMM against cuBLAS at 512 tokens (ncu_sparse_mma.txt)
#   bash scripts/gpu_run.sh tune_spread        # the weight-as-A decode's tiles (32/64 rows, 64/128 kept values per step,
#                                              # 2/4 warps, 3/4 stages) with the joined and the broadcast expansion, 2 and
#                                              # 16 tokens, three shapes (tune_spread.json)
#   bash scripts/gpu_run.sh tune_tma           # the same decode with its weight tiles copied by the Tensor Memory
#                                              # Accelerator: 64/128 rows, 64/128 kept values per step, 4/8 warps,
#                                              # 2-4 stages at 2, 16 and 64 tokens (tune_tma.json)
#   bash scripts/gpu_run.sh sparse_tc          # cuSPARSELt's 2:4 layout learned (probe_sparse_tc.py) and its GEMM,
#                                              # algorithm searched, against cuBLAS and the Triton GEMMs at 64-2048 tokens
#   bash scripts/gpu_run.sh cslt_buffer e2e     # cslt_buffer: auto and the decode on one cuSPARSELt buffer per layer
#                                              # (SparseLinear.use_cslt_layout) against the export's layout, 1-2048 tokens
#   bash scripts/gpu_run.sh tune_gather cslt_buffer_quick e2e   # tune_gather: the select kernel's map gather as
#                                              # pipelined 32-bit words (mapped) against one step ahead in registers
#                                              # (mapped_sync) and no map (decode), 1-2 tokens, four tiles
#   bash scripts/gpu_run.sh tune_pdl           # the decodes launched as programmatic dependents against plain
#                                              # launches, 0/4/8/16 MiB of weight prefetched before the wait,
#                                              # 1/2/16 tokens, three shapes (the plan's tiles)
#   bash scripts/gpu_run.sh tune_split_sum     # split-K summed by its last split in the kernel against a second
#                                              # launch (…_launch), the plan's tiles, 1024/4096/11008 rows, 1-16 tokens
#   bash scripts/gpu_run.sh tune_split_deep    # the tensor-core decodes at 4 and 16 tokens split 8 and 16 ways
#                                              # against the plan's one wave (2 programs per SM, 4 steps each)
#   bash scripts/gpu_run.sh dst_overhead       # DST steps with permutations none / random / learned (soft, hardened)
#                                              # at GPT-2 Small's shape, seq 1024, batch 8 (bench_dst_overhead_cuda.json)
#   bash scripts/gpu_run.sh moe                # one Mixtral-8x7B experts layer: transformers' grouped_mm and eager
#                                              # experts forwards against an export's 2:4 experts, the per-expert
#                                              # loop and the grouped kernel (CUDA graph), with and without maps,
#                                              # 1-512 tokens, and what auto picks
#   bash scripts/gpu_run.sh moe_stacked        # one Llama-4-Scout experts layer (its own bmm forward) against its
#                                              # experts served stacked: loop, grouped, auto, grouped with maps
#   bash scripts/gpu_run.sh e2e_compile        # end to end as e2e, each decode step by torch.compile(mode=
#                                              # "reduce-overhead") as users serve, dense against load's default
#   bash scripts/gpu_run.sh e2e_eager          # end to end as e2e, each decode step run eagerly (a plain generate()
#                                              # without CUDA graphs: the host's launches count), dense against
#                                              # load's default
#   bash scripts/gpu_run.sh e2e_moe            # end to end as e2e, 8 Mixtral-8x7B layers: dense (transformers'
#                                              # experts forward) against 2:4 experts with maps (~23 GB dense)
#   bash scripts/gpu_run.sh e2e_moe_compile    # e2e_moe with each decode step by torch.compile(mode="reduce-overhead"):
#                                              # the experts one operator each, the grouped kernel in the CUDA graph
#   bash scripts/gpu_run.sh warm_start         # a new process's first prompt and decode step: cold (Triton compiles,
#                                              # auto measures), auto measuring alone, auto's stored choices (a
#                                              # restart), 2 LLaMA-2-7B-shaped layers (bench_warm_start.json)
#   bash scripts/gpu_run.sh profile            # Nsight Compute on the decode kernels and cuBLAS (ncu_decode.txt)
#   bash scripts/gpu_run.sh profile_swap       # the same on decode_swap, with its tile expanded by broadcasts, and cuBLAS
#                                              # at 16 tokens (ncu_swap.txt: where their warps stall)
#   bash scripts/gpu_run.sh spread             # the weight-as-A decodes' tiles and expansions (decode_swap, _narrow, _sync,
#                                              # and the broadcast expansion's decode_swap_spread, _spread_sync) with
#                                              # auto and cuBLAS, the 6 shapes at 2-16 and 64 tokens (bench_spread.json)
#   bash scripts/gpu_run.sh kernel e2e tune_scratch   # tune_scratch: the scratch fill's tile (prefill) and the
#                                              # select decode at 2–16 tokens
#   bash scripts/gpu_run.sh perm_cost perm_cost_tf32 kernel tune tune_group e2e
#
#   SMOKE=1 bash scripts/gpu_run.sh next      # before a GPU call, on the CPU: every named step's script with
#                                             # --smoke (tiny shapes, TRITON_INTERPRET=1, .venv's python), so a
#                                             # broken step is found here and not in the device's minutes;
#                                             # nothing is copied to $OUT and no results file is touched
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu_out}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then PY=${PY:-.venv/bin/python}; export TRITON_INTERPRET=1; else PY=${PY:-python3}; fi
# the device tool stops a call at 600 s, before the last step's file is copied: the steps stop by BUDGET_S
if [ "$SMOKE" = 1 ]; then BUDGET_S=${BUDGET_S:-0}; else BUDGET_S=${BUDGET_S:-570}; fi
CALL_START=$(date +%s)   # files older than this are an earlier call's (leave_out reads only this call's)
FILLING=0   # 1 while a `fill` step runs: it starts only if its whole limit fits in the budget
mkdir -p "$OUT"
SP=$(mktemp -d)
cp -r shuffleprune "$SP/" && cp -r kernels "$SP/shuffleprune/kernels" && cp -r calib "$SP/shuffleprune/calib"
export PYTHONPATH="$SP" PYTHONUNBUFFERED=1
export SHUFFLEPRUNE_AUTO_STORE=0   # every step measures auto's choices itself (warm_start sets the store up itself)
[ "$SMOKE" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
# the versions, then the NVRTC the sparse-MMA kernels compile with and whether it compiles (a missing builtins library)
$PY -c "import torch, triton, transformers, scipy; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'); from shuffleprune.kernels.cuda_rtc import nvrtc_status; print(nvrtc_status())"
status=0
# the sparse-tensor-core kernels' variants (decode and prompt GEMM, every form the steps launch) compiled by NVRTC on
# 12 of the machine's cores beside the first step (compile_ahead.py), so the steps load their cubins instead of
# compiling each in their own time; its line goes to gpu_run_steps.txt at the end
AHEAD_PID=
if [ "$SMOKE" = 1 ]; then
    $PY scripts/compile_ahead.py --capability 9.0 --list || status=1
else   # GPU 0's capability and SMs asked of the driver (no CUDA context, no GPU memory)
    : > "$SP/compile_ahead.log"
    $PY scripts/compile_ahead.py --jobs 12 >> "$SP/compile_ahead.log" 2>&1 &
    AHEAD_PID=$!
fi
fits() {  # fits LIMIT_S: whether a fill step of that limit may start now
    [ "$FILLING" = 0 ] || [ "$BUDGET_S" -le 0 ] || [ "$1" -le $((BUDGET_S - SECONDS)) ]
}
step() {  # step NAME LIMIT_S RESULT_FILE COMMAND...
    local name=$1 limit=$2 result=$3; shift 3
    if [ "$SMOKE" = 1 ]; then   # the script's own CPU check, where it has one
        if [ "$1" != "$PY" ] || ! grep -q 'args.smoke' "$2"; then echo "=== $name: no CPU smoke (skipped)"; return; fi
        local a args=(); for a in "$@"; do [ "$a" = cuda ] && args+=(cpu) || args+=("$a"); done   # --device cuda
        set -- "${args[@]}" --smoke; limit=$((limit * 3))
    fi
    if [ "$BUDGET_S" -gt 0 ]; then
        local left=$((BUDGET_S - SECONDS))
        if [ "$left" -lt 15 ] || ! fits "$limit"; then
            echo "=== $name: skipped (limit ${limit}s, ${left}s of BUDGET_S=$BUDGET_S left)"
            [ "$SMOKE" = 1 ] || echo "$name skipped limit=$limit left=$left" >> "$OUT/gpu_run_steps.txt"
            return
        fi
        [ "$limit" -gt "$left" ] && { echo "=== $name: limit ${limit}s cut to the ${left}s left"; limit=$left; }
    fi
    echo "=== $name: $* (limit ${limit}s)"
    local t0=$SECONDS
    local rc=0; timeout "$limit" "$@" || { rc=$?; echo "=== $name FAILED (rc $rc)"; status=1; }
    echo "=== $name took $((SECONDS - t0)) s"
    [ "$SMOKE" = 1 ] || echo "$name rc=$rc seconds=$((SECONDS - t0)) limit=$limit" >> "$OUT/gpu_run_steps.txt"
    [ "$SMOKE" = 1 ] || { [ -f "$result" ] && cp "$result" "$OUT/"; }
    [ "$SMOKE" = 1 ] || { [ -f "${result%.json}_hung.json" ] && cp "${result%.json}_hung.json" "$OUT/"; }   # a hang
}
leave_out() {  # the sparse-tensor-core kernels this call's sparse_mma / sparse_gemm found hung or all wrong: left out
    # of the steps after (SHUFFLEPRUNE_SKIP_IMPLS), each with its reason in gpu_run_steps.txt
    local names
    if [ "$SMOKE" = 1 ]; then names=$($PY scripts/leave_out.py --smoke) || status=1; return; fi
    names=$($PY scripts/leave_out.py --since "$CALL_START" 2>> "$OUT/gpu_run_steps.txt")
    [ -n "$names" ] || return 0
    export SHUFFLEPRUNE_SKIP_IMPLS=${SHUFFLEPRUNE_SKIP_IMPLS:+$SHUFFLEPRUNE_SKIP_IMPLS,}$names
    echo "=== left out from here on (hung or wrong in the steps before): $names"
}
# A session has 15 minutes of device time in all, the machine's start (about 30 s) included, and one call runs
# 600 s at most. On 2026-11-27 (H100, 3616890) one call ran fast_launch 38 s, host 54, kernel 125, e2e 150, targets 4
# and e2e_eager 93 (476 s), a second e2e_compile 115 and gather 55: every step of the issue's tables then, the
# fast launches checked bit for bit. That second call's targets step read the committed kernel and e2e files,
# not the first call's (each call starts from this checkout), so targets now runs only in a call that ran kernel
# or e2e. On 2026-11-28 (H200, stop 74) tune_bw_select 34 s, tune_bw_swap 53, e2e 148, targets 5, moe 114 and
# e2e_compile 141, in four calls. issue24 is now what changed after those: kernel (auto with the half-step
# weight-as-A candidate decode_swap_narrow, the H200 sweep's pick on 11008x4096), moe (mapped experts through
# the pairs' gather, against the kernel reading the maps, nm_grouped_mapped_in_kernel), the targets, and
# tune_swap_sync: the weight-as-A decode on 16- and 32-row tiles of 1-2 warps (the synchronous mma, more programs
# per SM; sweeps before had 64 and 128 rows, all wgmma), whose 32-row tile auto now weighs. Since stop 77 the
# kernel table also times the resident-input decode (decode_resident, with and without a map: the map read once
# per program) and auto_tiled, the layer as load holds it on Hopper (one cuSPARSELt buffer), which the targets
# judge too; e2e follows in the same call so the targets read both tables of one checkout. Since stop 78 it
# times the TMA-fed decodes too (decode_swap_tma at 2-64 tokens, decode_resident_tma at 1-2). next1: Nsight
# Compute on decode_swap (since stop 82 the compile table's shared ceiling says the tensor-core decodes' trip of
# the expanded tile through shared memory caps them near an H100's bandwidth; the profile's memory workload and
# warp stalls test that), tune_tma, the TMA decode's tiles (rows, kept values per step, warps, stages) at 2, 16
# and 64 tokens, and tune_tall; the compiled e2e table moved to next2; moe moved to next7. pipeline (the commands users type on CUDA) ran whole on the H200 on 2026-11-28 and is a
# step of its own now;
# next2..next6 the rest, one call each (limits summing to at most 600 s), in the order they matter to the issue;
# the default call ends with `fill`: those of next1..next7 that fit in the seconds its first steps left (on the
# H200 kernel, e2e and targets took about 270 s of their 480 s of limits);
# next7 issue 6's DST step cost at GPT-2 Small's shape with the soft permutations now on the GPU
# (each step's seconds go to $OUT/gpu_run_steps.txt for later plans); next: issue24 and all seven, for the CPU
# smoke run.
# Since stop 86 issue24 is what that session built on the CPU: the weight-as-A decode with its 2:4 tile
# expanded by broadcasts (decode_swap_spread, _spread_sync: compiled for sm_90a, the expanded tile no longer
# goes through shared memory to reach the MMA's layout), which auto now weighs: the whole per-layer table
# (kernel, whose auto rows the targets judge), then e2e, where the file now also records the stacked layers'
# choices and a profile of one eager prompt (stop 85: the default layout's eager prompt took 2.66x dense's,
# 1.41x with dependent launches off), and the targets; next1 (filled in as time allows, else the next call)
# sweeps the broadcast tiles (tune_spread) and profiles decode_swap, its broadcast form and cuBLAS
# (profile_swap: never run before, its three profiles never fit). `spread` alone times the weight-as-A
# decodes' tiles and expansions with auto and cuBLAS (a quicker look than kernel).
# Since stop 87 issue24 starts with sparse_mma: the decode on the sparse tensor cores (kernels/nm_sparse_mma.cu,
# mma.sp through NVRTC; run on the CPU only under the tests' emulator), checked against a dense bf16 matmul and
# timed against cuBLAS at 1-64 tokens on four of the six shapes in cuSPARSELt's layout, without a map and reading a
# random one itself at 1-16 tokens, each with the default and the tall plan (since stop 88: CTAs of 64 rows sharing
# an input staged in shared memory), the map's with and without its L2 prefetch (tune_sparse_mma.json); kernel then
# has auto weigh them (and times them alone as decode_sparse_mma, _nomap, _tiled, _tall_tiled, _mapped_tall_tiled).
# next1 begins with its tile sweep.
# Since stop 90 the fill begins with mma_ceiling (40 s): mma.sp's, mma's and Hopper's wgmma.sp's and wgmma's own rates,
# in a process of its own (its wgmma part never ran on a GPU), which say whether the prompt GEMM on mma.sp can pass
# cuBLAS at all or wgmma.sp is the way; sparse_gemm records the mma half in-process beside its rows. next1 then
# begins with tune_sparse_mma_bounds (the decode's register bound, 0 / 5 / 6 CTAs an SM).
# Since stop 91 sparse_gemm also times the prompt GEMM on Hopper's wgmma.mma_async.sp (gemm_sparse_wgmma: its tiles
# with 4 stages; mma.sp's with 3 only, to keep the step's count of timings), kernel has auto weigh it, and next1
# begins with tune_sparse_gemm (both forms' other stage counts and splits, all four shapes). Up to 64
# tokens gemm_sparse_wgmma runs as a decode (CTAs of 64 rows x 8-64 tokens, 4 an SM): kernel times it from 1 token,
# at one token without a map too, and to 16 reading one itself (gemm_sparse_wgmma_mapped: the map's cost to it).
# Since stop 92 the call first starts compile_ahead.py in the background (NVRTC, 12 processes: the ~140 sparse-MMA and
# GEMM variants the steps launch, a second each when a step compiled them itself), and kernel times the rows the
# targets read (dense, auto and its layouts) on every shape before the other candidates: a kernel step its limit
# cuts short keeps the target table. sparse_mma and sparse_gemm end at once on a check launch that hangs (10 s, named
# in tune_sparse_*_hung.json), and after each, leave_out.py's kernels (hung, or wrong on every check) are left out
# of the later steps; auto's own check stops on a candidate that hangs (30 s) with a DeviceFault naming it.
ISSUE24=(sparse_mma sparse_gemm kernel targets)    # limits 165 + 120 + 260 + 10 s (kernel 175 s on the H200): the
                                                    # sparse-MMA decode and prompt GEMM checked and timed, then the
                                                    # kernel table and the targets read from it; e2e (met on the H200
                                                    # at stop 85) heads the queue after them, run if it fits
NEXT1=(tune_sparse_gemm tune_sparse_mma_bounds tune_sparse_mma profile_sparse_mma tune_spread profile_swap tune_tall)   # 120 + 90 + 150 + 90 + 7 × 70 + 90 + 3 × 70 + 150 s
                                                    # (the sparse-MMA decode's register bound: CTAs an SM must hold,
                                                    # 0, 5 or 6; its tiles: warps and CTAs along K, m-tiles,
                                                    # stages, row warps against the tall plan, and Nsight Compute on
                                                    # both plans at 1-64 tokens, bank conflicts included; the
                                                    # broadcast expansion's tiles against the joined one's; Nsight
                                                    # Compute on decode_swap, its broadcast form and cuBLAS at 16
                                                    # tokens; tune_tall's 63 GEMM timings)
NEXT2=(moe_stacked e2e_compile)                     # 300 + 280 s (e2e_compile 141 s on the H200)
NEXT3=(e2e_moe warm_start)                          # 400 + 190 s (e2e_moe_compile, 420 s, a call of its own after it;
                                                    # warm_start: three processes, cold / measuring / stored choices)
NEXT4=(e2e_eager e2e_compile)                       # 200 + 280 s (93 and 115 s on 3616890)
NEXT5=(fast_launch host gather cslt_buffer_quick)   # 90 + 60 + 120 + 90 s (38, 54 and 55 s on 3616890)
NEXT6=(cslt_buffer tune_split_sum)                  # 240 + 170 s: the cuSPARSELt-buffer table again, split-K summed in-kernel
NEXT7=(dst_overhead moe)                            # 200 + 300 s: issue 6's DST step cost at GPT-2 Small's shape on
                                                    # the GPU; the Mixtral experts layer (114 s on the H200)
FILL=(mma_ceiling e2e targets "${NEXT1[@]}" "${NEXT2[@]}" "${NEXT3[@]}" "${NEXT4[@]}" "${NEXT5[@]}" "${NEXT6[@]}" "${NEXT7[@]}")
[ $# -eq 0 ] && set -- issue24 fill
steps=(); for s in "$@"; do case $s in
    fill) for f in "${FILL[@]}"; do steps+=("+$f"); done ;;   # "+": run only if it fits (and not run already)
    tune_tiles) steps+=(tune_select tune_dot tune_gemm) ;;
    issue24) steps+=("${ISSUE24[@]}") ;;
    next1) steps+=("${NEXT1[@]}") ;;
    next2) steps+=("${NEXT2[@]}") ;;
    next3) steps+=("${NEXT3[@]}") ;;
    next4) steps+=("${NEXT4[@]}") ;;
    next5) steps+=("${NEXT5[@]}") ;;
    next6) steps+=("${NEXT6[@]}") ;;
    next7) steps+=("${NEXT7[@]}") ;;
    next) steps+=("${ISSUE24[@]}" e2e targets "${NEXT1[@]}" pipeline "${NEXT2[@]}" "${NEXT3[@]}" "${NEXT4[@]}" "${NEXT5[@]}" "${NEXT6[@]}" "${NEXT7[@]}"
                  e2e_moe_compile) ;;
    *) steps+=("$s") ;;
esac; done
set -- "${steps[@]}"
ran=()   # the steps of this call so far
for s in "$@"; do
    FILLING=0
    if [ "${s#+}" != "$s" ]; then
        s=${s#+}; FILLING=1
        [[ " ${ran[*]} " == *" $s "* ]] && continue   # queued twice (e2e_compile), or named in this call
    fi
    ran+=("$s")
    case $s in
        perm_cost) step perm_cost 280 scripts/results/bench_perm_cost.json \
            $PY scripts/bench_perm_cost.py --llama7b-block --device cuda --windows 128 --seqlen 1024 --batch 4 --steps 10 ;;
        perm_cost_tf32) step perm_cost_tf32 150 scripts/results/bench_perm_cost.json \
            $PY scripts/bench_perm_cost.py --llama7b-block --device cuda --windows 128 --seqlen 1024 --batch 4 --steps 10 --tf32 --no-search ;;
        kernel) step kernel 260 scripts/results/bench_kernel.json $PY scripts/bench_kernel.py --warm-jobs 15 --warm-serving
            # a kernel that faulted the GPU in the table's compile pass is left out of the steps after it too
            faulted=$($PY -c "import json; print(','.join(json.load(open('scripts/results/bench_kernel.json')).get('skipped_impls', [])))" 2>/dev/null)
            [ -n "$faulted" ] && { export SHUFFLEPRUNE_SKIP_IMPLS=$faulted; echo "=== left out from here on (they faulted the GPU): $faulted"; } ;;
        tune) step tune 150 scripts/results/tune_kernel.json $PY scripts/tune_kernel.py --variants gather ;;
        tune_group) step tune_group 150 scripts/results/tune_kernel_group.json $PY scripts/tune_kernel.py --variants group \
            --block-r 8 16 32 --block-k 128 256 512 --num-warps 4 8 --out scripts/results/tune_kernel_group.json ;;
        tune_select) step tune_select 130 scripts/results/tune_select.json $PY scripts/tune_kernel.py --variants select \
            --tokens 1 2 --block-r 16 32 --block-k 128 256 --num-warps 4 8 --stages 3 4 \
            --out scripts/results/tune_select.json ;;
        tune_dot) step tune_dot 250 scripts/results/tune_dot.json $PY scripts/tune_kernel.py --variants dot \
            --tokens 2 16 32 64 --block-r 32 64 128 --block-k 64 128 --num-warps 4 8 --stages 3 4 \
            --max-tile 524288 --out scripts/results/tune_dot.json ;;
        tune_decode) step tune_decode_select 130 scripts/results/tune_decode_select.json $PY scripts/tune_kernel.py \
                --variants select --tokens 1 --block-r 16 32 --block-k 128 256 --num-warps 4 --stages 3 4 \
                --splits 0 1 2 4 --out scripts/results/tune_decode_select.json
            step tune_decode_dot 170 scripts/results/tune_decode_dot.json $PY scripts/tune_kernel.py \
                --variants dot --tokens 2 16 64 --block-r 32 64 --block-k 64 128 --num-warps 4 8 --stages 3 4 \
                --splits 0 1 2 4 --max-tile 262144 --out scripts/results/tune_decode_dot.json ;;
        tune_swap) step tune_swap_decode 200 scripts/results/tune_swap_decode.json $PY scripts/tune_kernel.py \
                --variants swap dot --tokens 2 4 16 64 --block-r 64 128 --block-k 32 64 128 --num-warps 4 8 \
                --stages 3 4 --max-tile 1048576 --out scripts/results/tune_swap_decode.json
            step tune_mapped 120 scripts/results/tune_mapped.json $PY scripts/tune_kernel.py --variants mapped decode \
                --tokens 1 --block-r 16 32 64 --block-k 128 256 --num-warps 4 --stages 4 --splits 0 1 2 4 \
                --max-tile 1048576 --out scripts/results/tune_mapped.json
            step tune_swap_gemm 150 scripts/results/tune_swap_gemm.json $PY scripts/tune_kernel.py \
                --variants gemm gemm_swap --tokens 64 512 2048 --out scripts/results/tune_swap_gemm.json ;;
        sparse_tc) step sparse_tc_layout 120 scripts/results/sparse_tc_layout.json $PY scripts/probe_sparse_tc.py
            step sparse_tc_bench 240 scripts/results/bench_sparse_tc.json $PY scripts/bench_kernel.py --tokens 64 512 2048 \
                --impls auto scratch gemm gemm_swap semi_structured semi_cutlass cslt \
                --out scripts/results/bench_sparse_tc.json ;;
        spread) step spread 120 scripts/results/bench_spread.json $PY scripts/bench_kernel.py --tokens 2 4 8 16 64 \
                --impls auto decode_swap decode_swap_narrow decode_swap_sync decode_swap_spread decode_swap_spread_sync \
                --out scripts/results/bench_spread.json ;;
        cslt_buffer) step cslt_buffer 240 scripts/results/bench_kernel_cslt.json $PY scripts/bench_kernel.py \
                --impls auto auto_tiled decode_nomap decode_tiled --out scripts/results/bench_kernel_cslt.json ;;
        gather) step gather 120 scripts/results/bench_gather.json $PY scripts/bench_kernel.py --warm-jobs 15 \
                --shapes 4096x4096 4096x11008 4096x14336 --tokens 1 16 512 2048 \
                --impls auto auto_tiled scratch scratch_mapped \
                --out scripts/results/bench_gather.json ;;
        cslt_buffer_quick) step cslt_buffer_quick 90 scripts/results/bench_kernel_cslt_quick.json $PY scripts/bench_kernel.py \
                --shapes 11008x4096 4096x14336 1024x4096 --tokens 1 2 16 --impls auto auto_tiled decode decode_tiled \
                --out scripts/results/bench_kernel_cslt_quick.json ;;
        tune_bandwidth) step tune_bw_select 150 scripts/results/tune_bw_select.json $PY scripts/tune_kernel.py \
                --variants select --shapes 4096x4096 11008x4096 4096x14336 --tokens 1 2 --block-r 16 32 \
                --block-k 128 256 --num-warps 4 --stages 4 6 --splits 0 2 --out scripts/results/tune_bw_select.json
            step tune_bw_swap 210 scripts/results/tune_bw_swap.json $PY scripts/tune_kernel.py \
                --variants swap --shapes 4096x4096 11008x4096 4096x14336 --tokens 2 4 16 --block-r 64 \
                --block-k 64 128 256 --num-warps 4 --stages 3 4 6 --splits 0 2 4 --max-tile 1048576 \
                --out scripts/results/tune_bw_swap.json ;;
        sparse_mma) step sparse_mma 165 scripts/results/tune_sparse_mma.json $PY scripts/tune_sparse_mma.py \
                --probe --layouts tiled --maps none random --tall 0 1 --prefetch -1 0 --inline 0 1 --tokens 1 2 4 8 16 64 \
                --shapes 4096x4096 14336x4096 4096x14336 1024x4096 \
                --out scripts/results/tune_sparse_mma.json
            # a reading of the MMA's fragments other than the kernel's own, if the probe found one right: the steps
            # after it run with it too (SHUFFLEPRUNE_SPARSE_MMA_READING)
            reading=$($PY -c "import json; r = json.load(open('scripts/results/tune_sparse_mma.json')).get('reading'); print(','.join(r or []))" 2>/dev/null)
            [ -n "$reading" ] && { export SHUFFLEPRUNE_SPARSE_MMA_READING=$reading; echo "=== the sparse-MMA decode reads its fragments as: $reading"; }
            leave_out ;;
        sparse_gemm) step sparse_gemm 120 scripts/results/tune_sparse_gemm.json $PY scripts/tune_sparse_gemm.py \
                --shapes 4096x4096 14336x4096 1024x4096 --tokens 64 512 2048 --stages 3 --wgmma-stages 4 --splits 0 1 \
                --layouts tiled --out scripts/results/tune_sparse_gemm.json
            leave_out ;;
        tune_sparse_gemm) step tune_sparse_gemm 120 scripts/results/tune_sparse_gemm_sweep.json \
                $PY scripts/tune_sparse_gemm.py --shapes 4096x4096 11008x4096 4096x14336 1024x4096 --tokens 1 16 64 512 2048 \
                --stages 4 --wgmma-stages 3 5 --splits 0 2 --layouts tiled --out scripts/results/tune_sparse_gemm_sweep.json ;;
        mma_ceiling) step mma_ceiling 40 scripts/results/mma_ceiling.json $PY scripts/mma_ceiling.py ;;
        tune_sparse_mma_bounds) step tune_sparse_mma_bounds 90 scripts/results/tune_sparse_mma_bounds.json \
                $PY scripts/tune_sparse_mma.py --layouts tiled --shapes 4096x4096 14336x4096 --tokens 1 16 \
                --maps none random --inline 0 1 --min-ctas 0 5 6 --out scripts/results/tune_sparse_mma_bounds.json ;;
        tune_sparse_mma) step tune_sparse_mma 150 scripts/results/tune_sparse_mma_sweep.json $PY scripts/tune_sparse_mma.py \
                --layouts tiled --shapes 4096x4096 11008x4096 4096x14336 --tokens 1 16 64 --kw 0 2 8 \
                --splits 0 1 4 --mt 0 2 --stages 0 3 --out scripts/results/tune_sparse_mma_sweep.json
            step tune_sparse_mma_rows 90 scripts/results/tune_sparse_mma_rows.json $PY scripts/tune_sparse_mma.py \
                --layouts tiled --shapes 4096x4096 14336x4096 1024x4096 --tokens 4 16 64 --tall 0 1 --rw 0 1 2 4 \
                --kw 0 1 2 --out scripts/results/tune_sparse_mma_rows.json ;;
        tune_spread) step tune_spread 90 scripts/results/tune_spread.json $PY scripts/tune_kernel.py \
                --variants swap swap_spread --shapes 4096x4096 11008x4096 4096x14336 --tokens 2 16 --block-r 32 64 \
                --block-k 64 128 --num-warps 2 4 --stages 3 4 --max-tile 1048576 \
                --out scripts/results/tune_spread.json ;;
        tune_tall) step tune_tall 150 scripts/results/tune_tall.json $PY scripts/tune_kernel.py \
                --variants gemm_swap gemm_swap_tall --tokens 64 512 2048 --out scripts/results/tune_tall.json ;;
        tune_tma) step tune_tma 150 scripts/results/tune_tma.json $PY scripts/tune_kernel.py \
                --variants swap_tma --shapes 4096x4096 11008x4096 4096x14336 --tokens 2 16 64 --block-r 64 128 \
                --block-k 64 128 --num-warps 4 8 --stages 2 3 4 --max-tile 1048576 \
                --out scripts/results/tune_tma.json ;;
        tune_swap_sync) step tune_swap_sync 90 scripts/results/tune_swap_sync.json $PY scripts/tune_kernel.py \
                --variants swap --shapes 4096x4096 11008x4096 4096x14336 --tokens 2 4 16 --block-r 16 32 \
                --block-k 64 128 --num-warps 1 2 --stages 3 4 --max-tile 1048576 \
                --out scripts/results/tune_swap_sync.json ;;
        tune_pdl) step tune_pdl 150 scripts/results/tune_pdl.json $PY scripts/tune_kernel.py \
                --variants decode decode_pdl swap swap_pdl mapped mapped_pdl --shapes 1024x4096 4096x4096 11008x4096 \
                --tokens 1 2 16 --block-r 0 --block-k 0 --num-warps 0 --stages 4 --prefetch-mb 0 4 8 16 \
                --out scripts/results/tune_pdl.json ;;
        tune_gather) step tune_gather 150 scripts/results/tune_gather.json $PY scripts/tune_kernel.py \
                --variants mapped mapped_sync decode --tokens 1 2 --block-r 16 32 --block-k 128 256 --num-warps 4 \
                --stages 4 --out scripts/results/tune_gather.json ;;
        tune_split_sum) step tune_split_sum 170 scripts/results/tune_split_sum.json $PY scripts/tune_kernel.py \
                --variants decode decode_launch swap swap_launch mapped mapped_launch --shapes 1024x4096 4096x4096 \
                11008x4096 --tokens 1 2 4 16 --block-r 0 --block-k 0 --num-warps 0 --stages 4 \
                --out scripts/results/tune_split_sum.json ;;
        tune_split_deep) step tune_split_deep 200 scripts/results/tune_split_deep.json $PY scripts/tune_kernel.py \
                --variants swap mapped dot --shapes 4096x4096 11008x4096 4096x11008 --tokens 4 16 --block-r 0 \
                --block-k 0 --num-warps 0 --stages 4 --splits 0 8 16 --out scripts/results/tune_split_deep.json ;;
        tune_scratch) step tune_scratch 90 scripts/results/tune_scratch.json $PY scripts/tune_kernel.py \
                --variants decompress --tokens 512 --block-r 8 16 32 64 --block-k 64 128 256 --num-warps 4 8 \
                --max-tile 1048576 --out scripts/results/tune_scratch.json
            step tune_select_tokens 120 scripts/results/tune_select_tokens.json $PY scripts/tune_kernel.py \
                --variants select --tokens 2 4 8 16 --block-r 16 --block-k 128 256 --num-warps 4 8 --stages 4 \
                --splits 0 1 --max-tile 1048576 --out scripts/results/tune_select_tokens.json ;;
        profile|profile_swap|profile_sparse_mma) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
            if [ "$s" = profile ]; then RES=scripts/results/ncu_decode.txt
                cases=("select 1 11008x4096" "dot 2 11008x4096" "dot 16 11008x4096" "swap 16 11008x4096" "dense 1 11008x4096"
                       "select 1 4096x4096" "dense 1 4096x4096")
            elif [ "$s" = profile_sparse_mma ]; then RES=scripts/results/ncu_sparse_mma.txt   # the sparse-MMA decode
                cases=("sparse_mma 1 11008x4096" "sparse_mma 16 11008x4096" "sparse_mma_tall 16 11008x4096"
                       "sparse_mma 64 4096x4096" "sparse_mma_tall 64 4096x4096" "sparse_gemm 512 4096x4096"
                       "dense 512 4096x4096")
            else RES=scripts/results/ncu_swap.txt   # the weight-as-A decode's expansions: joined against broadcast
                cases=("swap 16 11008x4096" "swap_spread 16 11008x4096" "dense 16 11008x4096"); fi
            [ "$SMOKE" = 1 ] && RES=$SP/$(basename $RES)   # a CPU check leaves the committed profile alone
            if [ "$BUDGET_S" -gt 0 ] && [ $((70 * ${#cases[@]})) -gt $((BUDGET_S - SECONDS)) ]; then
                echo "=== $s: skipped (${#cases[@]} profiles of 70 s do not fit)"
                echo "$s skipped limit=$((70 * ${#cases[@]})) left=$((BUDGET_S - SECONDS))" >> "$OUT/gpu_run_steps.txt"
                continue
            fi
            : > $RES
            for case in "${cases[@]}"; do
                read -r kern toks shape <<< "$case"
                echo "##### $kern tokens=$toks shape=$shape" >> $RES
                step "profile_${kern}_$toks" 70 $RES "$NCU" --clock-control none --profile-from-start off \
                    --launch-skip 3 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
                    --section MemoryWorkloadAnalysis_Tables \
                    --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
                    --section ComputeWorkloadAnalysis $PY scripts/profile_decode.py --kernel $kern --tokens $toks \
                    --shape $shape >> $RES 2>&1
            done ;;
        dst_overhead) step dst_overhead 200 scripts/results/bench_dst_overhead_cuda.json $PY scripts/bench_dst_overhead.py \
            --config-kw n_layer=12,n_embd=768,n_head=12 --vocab 50257 --seq-len 1024 --batch-size 8 \
            --methods srigl dsb diag --steps 3 --rounds 3 --device cuda --out scripts/results/bench_dst_overhead_cuda.json ;;
        kernel_fused) step kernel_fused 60 scripts/results/bench_kernel_fused.json $PY scripts/bench_kernel.py \
            --shapes 12288x4096 22016x4096 --tokens 1 2 16 --impls auto decode decode_nomap \
            --out scripts/results/bench_kernel_fused.json ;;
        tune_gemm) step tune_gemm 100 scripts/results/tune_gemm.json $PY scripts/tune_kernel.py --variants gemm \
            --tokens 64 128 256 512 2048 --gemm-tiles 128,128,64,8,3 64,128,64,4,3 \
            --out scripts/results/tune_gemm.json ;;
        stage_cost) step stage_cost 540 scripts/results/bench_stage_cost.json \
            $PY scripts/bench_stage_cost.py --device cuda ;;
        e2e) step e2e 240 scripts/results/bench_e2e.json $PY scripts/bench_e2e.py ;;
        pipeline) step pipeline 300 scripts/results/gpu_pipeline.json $PY scripts/gpu_pipeline.py ;;
        targets) if [[ " ${ran[*]} " != *" kernel "* && " ${ran[*]} " != *" e2e "* ]]; then   # the files a call
                echo "=== targets: neither kernel nor e2e ran in this call (skipped: it would read the committed files)"
            else step targets 10 scripts/results/gpu_targets.json $PY scripts/gpu_targets.py \
                --json scripts/results/gpu_targets.json; fi ;;
        e2e_compile) step e2e_compile 280 scripts/results/bench_e2e_compile.json $PY scripts/bench_e2e.py --decode compile ;;
        fast_launch) [ "$SMOKE" = 1 ] || rm -f scripts/results/fast_launch_cuda.json   # a failed check leaves no
            # file of an earlier run (a smoke run writes none, so it keeps the committed one)
            step fast_launch 90 scripts/results/fast_launch_cuda.json $PY scripts/check_fast_launch.py --gpu
            if [ "$SMOKE" != 1 ] && ! grep -q '"ok": true' scripts/results/fast_launch_cuda.json 2>/dev/null; then
                export SHUFFLEPRUNE_FAST_LAUNCH=0; echo "=== fast launches off for the steps after (the check failed)"
            fi ;;
        host) step host 60 scripts/results/bench_host_overhead_cuda.json $PY scripts/bench_host_overhead.py --gpu ;;
        e2e_eager) step e2e_eager 200 scripts/results/bench_e2e_eager.json $PY scripts/bench_e2e.py --decode eager ;;
        moe) step moe 300 scripts/results/bench_moe.json $PY scripts/bench_moe.py ;;
        moe_stacked) step moe_stacked 300 scripts/results/bench_stacked_moe.json $PY scripts/bench_stacked_moe.py ;;
        e2e_moe) step e2e_moe 400 scripts/results/bench_e2e_mixtral.json $PY scripts/bench_e2e.py --arch mixtral ;;
        warm_start) step warm_start 190 scripts/results/bench_warm_start.json $PY scripts/bench_warm_start.py ;;
        e2e_moe_compile) step e2e_moe_compile 420 scripts/results/bench_e2e_mixtral_compile.json $PY scripts/bench_e2e.py --arch mixtral --decode compile ;;
        *) echo "unknown step $s"; status=1 ;;
    esac
done
if [ -n "$AHEAD_PID" ]; then   # long done, as a rule (about 140 variants, a second each, 12 at a time)
    unfinished=; pkill -TERM -P "$AHEAD_PID" 2>/dev/null   # its compiling processes first
    kill "$AHEAD_PID" 2>/dev/null && unfinished=" (unfinished: stopped at the call's end)"
    wait "$AHEAD_PID" 2>/dev/null
    echo "$(tail -n 3 "$SP/compile_ahead.log" | tr '\n' ' ')$unfinished" | tee -a "$OUT/gpu_run_steps.txt"
fi
rm -rf "$SP"
exit $status
