#!/usr/bin/env bash
# One call on a GPU machine: install, then the named parts; logs under $OUT.
#   bash benchmarks/run_gpu.sh [part ...]     parts: table14 tests stages stagesab fwdab dequant pending split switchsplit autoab abforward embedding gradcasts dbias linear step small threads layers mlp profile proflinear profsmall smallloop dims refusion hot handoff tiles kernels checks graphed host hostcost dact gpt switch dist disttests determinism profgpt attn attnhopper attnsweep attngpt fp8attn ncuattn grouped norm launches workspace
#   (no part: tests layers refusion kernels; torchao wheels, if any, in .whl/)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/te_fuser_out}; mkdir -p "$OUT"
parts=${*:-tests layers refusion kernels}
# table14: #14's closing table in one call of under ten minutes: the GPU tests of the paths the
# table runs that changed last (GPU_TESTS), the GPT's schedule in three processes (at most 150 s
# each), then the small Linear's loop in turns
if [ "$parts" = "table14" ]; then
  export GPT_ROUNDS=${GPT_ROUNDS:-3} GPT_TIMEOUT=${GPT_TIMEOUT:-150} SMALL_ROUNDS=${SMALL_ROUNDS:-20} \
    GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-150} GPU_TESTS=${GPU_TESTS:-"tests/test_lean_entries_gpu.py \
    tests/test_triton_activation.py tests/test_activations.py tests/test_forward_linear_bias_linear.py tests/test_training.py \
    tests/test_reset_parameters.py"}
  parts="tests gpt smallloop"
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >>"$OUT/install.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
for part in $parts; do
  case $part in
    tests)
      # GPU_TESTS="tests/a.py tests/b.py" runs those files instead of the list below
      timeout ${GPU_TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_ops_gpu.py tests/test_triton_launch.py tests/test_triton_sum_rows.py tests/test_residual_input_grad.py tests/test_triton_activation.py \
        tests/test_weight_cache.py tests/test_training.py tests/test_train_gpt.py tests/test_torch_contracts.py \
        tests/test_fuser.py tests/test_cuda_gemm.py tests/test_cuda_cast.py tests/test_cuda_backend.py \
        tests/test_graphs.py tests/test_graphed_step.py tests/test_hot_guard.py tests/test_amax_column_sums.py tests/test_quantize_tensorwise_column_sums.py tests/test_triton_gpu_shapes.py tests/test_triton_norm.py \
        tests/test_forward_linear_bias_linear.py tests/test_delayed_scale_update.py tests/test_quantizer_delayed.py tests/test_quantizer_rowwise.py \
        tests/test_triton_embedding.py tests/test_embedding.py} \
        2>&1 | tee "$OUT/tests.log" | tail -15 ;;
    dequant)  # the Triton dequantization's per-tensor scale read once against looked up element by element
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_cast.py -k dequantize 2>&1 | tail -2
      timeout 120 python3 benchmarks/bench_dequantize.py 2>&1 | tee "$OUT/dequant.log" | tail -4 ;;
    embedding)  # the embedding's weight gradient: its tests, then beside torch's index_put_ and embedding backward
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_embedding.py tests/test_embedding.py 2>&1 \
        | tee "$OUT/embedding.log" | tail -4
      timeout 120 python3 benchmarks/bench_embedding.py 2>&1 | tee -a "$OUT/embedding.log" | tail -10 ;;
    gradcasts)  # the CUDA output-gradient casts with and without the bias gradient, one launch and separate (GPU time)
      timeout 200 python3 benchmarks/bench_cast.py --gradient-casts 2>&1 | tee "$OUT/gradcasts.log" | tail -12 ;;
    dbias)  # the output gradient's cast with its bias gradient, separate and fused (16384x7168)
      timeout 150 python3 benchmarks/bench_cast.py --bias-grad --sweep 2>&1 | tee "$OUT/dbias.log" | tail -16 ;;
    linear) timeout 200 python3 benchmarks/bench_layers.py --cases linear 2>&1 | tee "$OUT/linear.log" | tail -12 ;;
    step)  # the graphed whole step: its tests, its example, the small Linear's loop
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_graphed_step.py tests/test_graphs.py 2>&1 \
        | tee "$OUT/step.log" | tail -8
      timeout 60 python3 examples/graphed_step.py 2>&1 | tee -a "$OUT/step.log" | tail -4 ;;
    smallloop)  # the small Linear's eager step against bf16 eager's, in turns (small_loop.py)
      timeout 200 python3 benchmarks/small_loop.py --rounds ${SMALL_ROUNDS:-30} --caller-backward 2>&1 \
        | tee "$OUT/smallloop.log" | tail -12 ;;
    small) timeout 200 python3 benchmarks/bench_layers.py --cases small 2>&1 | tee "$OUT/small.log" | tail -24 ;;
    mlp) timeout 200 python3 benchmarks/bench_layers.py --cases mlp 2>&1 | tee "$OUT/mlp.log" | tail -16 ;;
    gpt)  # the yardstick GPT on real text: the recipe schedule beside torch (and torchao), with validation (GPT_GRAPHED=1: te's steps graphed; GPT_CHECKPOINT=1: every block recomputed in the backward; GPT_SCHEDULE=...; GPT_PROFILE=phase: that phase's kernels per arm; GPT_SWITCH=phase: te's switch step into it under cProfile; GPT_TRACE_SWITCH=phase: that switch step and a step alone under torch.profiler; GPT_ROUNDS=n: n processes, then #14's table with each ratio's spread, benchmarks/gpt_table.py)
      for round in $(seq 1 ${GPT_ROUNDS:-1}); do
        json="$OUT/gpt.json"; [ "${GPT_ROUNDS:-1}" -gt 1 ] && json="$OUT/gpt_$round.json"
        timeout ${GPT_TIMEOUT:-420} python3 examples/train_gpt.py --size gpu --steps ${GPT_STEPS:-30} ${GPT_GRAPHED:+--graphed} ${GPT_CHECKPOINT:+--checkpoint} ${GPT_SCHEDULE:+--schedule $GPT_SCHEDULE} ${GPT_PROFILE:+--profile-phase $GPT_PROFILE} ${GPT_SWITCH:+--profile-switch $GPT_SWITCH} ${GPT_TRACE_SWITCH:+--trace-switch $GPT_TRACE_SWITCH} --json "$json" 2>&1 \
          | tee -a "$OUT/gpt.log" | tail -30
      done
      if [ "${GPT_ROUNDS:-1}" -gt 1 ]; then
        python3 benchmarks/gpt_table.py "$OUT"/gpt_*.json 2>&1 | tee "$OUT/gpt_table.log"
      fi ;;
    switch)  # what a recipe switch step costs: the tests of what switches reuse, then te's schedule in two processes,
      # each phase's first step (the switch) against its step timed alone ("1st/alone"; the target is 1.05x)
      timeout ${SWITCH_TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_quantizer_delayed.py \
        tests/test_quantizer_factory.py tests/test_fuser.py tests/test_graphed_step.py 2>&1 | tee "$OUT/switch_tests.log" | tail -3
      for run in 1 2; do
        timeout ${SWITCH_TIMEOUT:-150} python3 examples/train_gpt.py --size gpu --arms te \
          --schedule ${SWITCH_SCHEDULE:-bf16:10,delayed:10,current:10,bf16:10,delayed:10,current:10} \
          --json "$OUT/switch$run.json" 2>&1 | tee "$OUT/switch$run.log" | grep -A8 "1st/alone"
      done ;;
    dist)  # the GPT under FSDP2 on every GPU of the machine over NCCL (one GPU: a group of size 1, a smoke run);
      # NVLink multicast stays off, as the machines require (DIST_PROFILE=1: each arm's kernels; DIST_HOST_PROFILE=1: its host time by place; DIST_CALLER=1: backwards on the calling thread; DIST_ARMS=...)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
      for recipe in ${DIST_RECIPES:-current delayed}; do
        timeout ${DIST_TIMEOUT:-300} torchrun --standalone --nproc-per-node "$ngpu" benchmarks/bench_distributed.py \
          --recipe "$recipe" ${DIST_PROFILE:+--profile} ${DIST_HOST_PROFILE:+--host-profile} ${DIST_CALLER:+--caller-backward} ${DIST_ARMS:+--arms $DIST_ARMS} --json "$OUT/dist_$recipe.json" 2>&1 \
          | tee -a "$OUT/dist.log" | grep -v -E "Warn|warn_once|USDT" | tail -${DIST_TAIL:-10}
      done ;;
    disttests)  # the DDP / FSDP2 / DCP tests on the machine's GPUs over NCCL (a test of more ranks than GPUs skips)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      TE_FUSER_TEST_DIST=nccl timeout 400 python3 -m pytest -q -p no:cacheprovider -rs tests/test_distributed.py \
        tests/test_fsdp.py 2>&1 | tee "$OUT/disttests.log" | tail -12 ;;
    determinism)  # the smoke GPT trained three times eagerly and once graphed: the same loss bits
      timeout 200 python3 benchmarks/check_determinism.py --graphed --repeats 3 2>&1 | tee "$OUT/determinism.log" | tail -6 ;;
    profgpt) timeout 300 python3 benchmarks/profile_gpt.py --recipes ${PROF_RECIPES:-bf16 delayed current} --timed 5 --steps 2 ${PROF_HOST:+--host --dump $OUT} ${PROF_HOSTONLY:+--host-only} ${PROF_ATTENTION:+--attention $PROF_ATTENTION} ${PROF_COMPILE:+--compile} ${PROF_SOURCES:+--sources $PROF_SOURCES} ${PROF_PHASES:+--phases} ${PROF_SYNCS:+--syncs} ${PROF_INTERLEAVE:+--interleave $PROF_INTERLEAVE} ${PROF_SEPARATE:+--separate-launches} ${PROF_RUN:+--run-length $PROF_RUN} ${PROF_ONE:+--one-sequential} ${PROF_CALLER:+--caller-backward} ${PROF_PEERS:+--peers} ${PROF_AUTO:+--auto-entry $PROF_AUTO} ${PROF_GRAPHED:+--graphed} --clip ${PROF_CLIP:-1.0} 2>&1 | tee -a "$OUT/profgpt.log" | tail -80 ;;
    dims)  # x of any dims to the casts, GEMMs and LayerNorms that take it: their tests, then the GPT's step against
      # the same step reshaping to rows around them, in turns in one process (dims_ab.py)
      timeout 300 python3 -m pytest -q -p no:cacheprovider ${DIMS_TESTS:-tests/test_lean_entries_gpu.py \
        tests/test_any_dims.py tests/test_quantizer_lean_cast.py tests/test_quantizer_delayed.py tests/test_training.py} 2>&1 | tee "$OUT/dims_tests.log" | tail -6
      timeout 250 python3 benchmarks/dims_ab.py ${DIMS_ARGS:-} 2>&1 | tee "$OUT/dims.log" | tail -24 ;;
    new)  # this stop's tests on the GPU: the CUDA casts and state update, the row-wise recipe, the guard, training
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_quantizer_rowwise.py tests/test_delayed_scale_update.py \
        tests/test_cuda_cast.py tests/test_cuda_backend.py tests/test_amax_column_sums.py tests/test_triton_activation.py \
        tests/test_hot_guard.py tests/test_fuser.py tests/test_ops_gpu.py tests/test_training.py 2>&1 | tee "$OUT/new.log" | tail -15 ;;
    ncuattn)  # the attention kernels under Nsight Compute (ncu_attention.py): per kernel its duration, throughput,
      # occupancy, stall reasons and pipes, for our FP8 and bf16 forwards, Triton's backward and cuDNN's; the reports
      # and their CSVs in $OUT/ncu (NCU_TARGETS="fp8fwd bwd" for some, NCU_CASE=gpt for the GPT's shape, NCU_SOURCE=1
      # for the warps' stall samples per machine instruction instead)
      timeout 480 python3 benchmarks/ncu_attention.py --out "$OUT/ncu" --case ${NCU_CASE:-main} \
        ${NCU_TARGETS:+--targets $NCU_TARGETS} ${NCU_SOURCE:+--source} 2>&1 | tee "$OUT/ncuattn.log" | tail -60 ;;
    pending)  # what runs 191-193 left: the GPT through FP8-attention phases on the Hopper FP8 forward (now the auto
      # table's), te beside its eager twin for loss parity, then the GPU tests that train the GPT and graph FP8 attention
      timeout 400 python3 examples/train_gpt.py --size gpu --steps 20 --arms te,torch \
        --schedule bf16:20,current:20,current_dpa:20,delayed:20,delayed_mha:20 --json "$OUT/gptdpa.json" 2>&1 \
        | tee "$OUT/gptdpa.log" | tail -25
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_train_gpt.py tests/test_graphs.py 2>&1 | tee "$OUT/pending.log" | tail -6 ;;
    threads)  # the small Linear's backward with autograd's device threads and on the calling thread, split by
      # timestamps (backward_threads.py)
      timeout 200 python3 benchmarks/backward_threads.py 2>&1 | tee "$OUT/threads.log" | tail -8 ;;
    autoab)  # one kernel's auto entry on the GPT's eager step, two backends in turns in one process, at width 128
      # and at full size (auto_entry_ab.py; AB_KERNEL=dact_dbias, AB_ENTRIES="triton cuda")
      for size in "" "--full-size"; do
        timeout 200 python3 benchmarks/auto_entry_ab.py --kernel ${AB_KERNEL:-dact_dbias} --entries ${AB_ENTRIES:-triton cuda} \
          $size 2>&1 | tee -a "$OUT/autoab.log" | tail -4
      done ;;
    abforward)  # the cuda backend's bf16 attention forward, cuDNN's against our Hopper kernel, on the GPT's eager
      # step in turns in one process, at width 128 and at full size (auto_entry_ab.py --cuda-forward)
      for size in "" "--full-size"; do
        timeout 200 python3 benchmarks/auto_entry_ab.py --cuda-forward $size 2>&1 | tee -a "$OUT/abforward.log" | tail -4
      done ;;
    switchsplit)  # each switch step of te's schedule beside its steps alone, its builds, quantizers, state
      # placement and seeding casts timed inside it (switch_split.py; SWITCH_SCHEDULE=... sets the phases)
      timeout 200 python3 benchmarks/switch_split.py ${SWITCH_SCHEDULE:+--schedule $SWITCH_SCHEDULE} 2>&1 \
        | tee "$OUT/switchsplit.log" | tail -12 ;;
    split)  # where the host's step goes, without a profiler: the GPT at width 128 and at full size, the calls into
      # the extension and the Triton launches timed apart, and the layers above them (host_split.py --layers)
      timeout 200 python3 benchmarks/host_split.py --layers 2>&1 | tee "$OUT/split.log" | tail -28
      timeout 250 python3 benchmarks/host_split.py --layers --full-size --rounds 5 --steps 8 2>&1 \
        | tee "$OUT/split_full.log" | tail -28 ;;
    workspace)  # the FP8 GEMMs planned without cuBLASLt workspace (no memset before each): their tests, the GEMMs
      # one by one, then the GPT's eager step under each limit in turns, at full size and at width 128 (host cost)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gemm_workspace.py 2>&1 | tee "$OUT/workspace.log" | tail -2
      timeout 150 python3 benchmarks/count_launches.py --workspace-limit 0 --candidates 1 2>&1 | tee -a "$OUT/workspace.log" | head -40
      timeout 240 python3 benchmarks/gemm_workspace_ab.py 2>&1 | tee -a "$OUT/workspace.log" | tail -6
      timeout 120 python3 benchmarks/gemm_workspace_ab.py --tiny 2>&1 | tee -a "$OUT/workspace.log" | tail -6 ;;
    layers) timeout 300 python3 benchmarks/bench_layers.py 2>&1 | tee "$OUT/layers.log" | tail -24 ;;
    profile) timeout 200 python3 benchmarks/profile_kernels.py --case mlp 2>&1 | tee "$OUT/profile.log" | tail -60 ;;
    proflinear)  # the big Linear's kernels under current and delayed scaling
      for r in current delayed; do
        timeout 150 python3 benchmarks/profile_kernels.py --case linear --recipe $r --top 18 2>&1 | tee -a "$OUT/proflinear.log" | grep -A19 "te_fuser"
      done ;;
    profsmall)  # the small Linear's kernels, eager and graphed
      for r in current delayed; do
        timeout 100 python3 benchmarks/profile_kernels.py --case small --recipe $r --top 16 2>&1 | tee -a "$OUT/profsmall.log" | tail -20
        timeout 100 python3 benchmarks/profile_kernels.py --case small --recipe $r --top 16 --graphed 2>&1 \
          | tee -a "$OUT/profsmall.log" | grep -A17 "te_fuser"
      done ;;
    refusion)
      timeout 150 python3 benchmarks/bench_refusion.py --cold-cache --mlp-weights --json "$OUT/refusion.json" \
        --plot "$OUT/refusion.svg" 2>&1 | tee "$OUT/refusion.log" | tail -12 ;;
    tiles)  # the Triton tensorwise GEMM's tile sweep (256-deep tiles included) beside cuBLASLt, 8192^3
      timeout 300 python3 benchmarks/bench_gemm.py --sizes 8192 --backends triton cuda --sweep --sweep-families tensor \
        2>&1 | tee "$OUT/tiles.log" | tail -30 ;;
    handoff) timeout 200 python3 benchmarks/bench_handoff.py 2>&1 | tee "$OUT/handoff.log" | tail -12 ;;
    hot)  # the hot path, compiled and Python side by side, twice each
      for i in 1 2; do
        timeout 100 python3 benchmarks/bench_refusion.py --hot-only --json "$OUT/hot$i.json" 2>&1 | tee -a "$OUT/hot.log" | tail -6
        TE_FUSER_HOT_GUARD=0 timeout 100 python3 benchmarks/bench_refusion.py --hot-only 2>&1 | tee -a "$OUT/hot.log" | tail -6
      done ;;
    kernels)  # the kernels, with auto side by side with triton and cuda; the casts also with the exact FP8 encoding
      timeout 300 python3 benchmarks/bench_cast.py 2>&1 | tee "$OUT/cast.log" | tail -40
      timeout 200 python3 benchmarks/bench_gemm.py 2>&1 | tee "$OUT/gemm.log" | tail -24 ;;
    checks)  # every FP8-writing Triton kernel bit for bit, with the hardware and the exact FP8 encoding
      [ -f benchmarks/check_gpu_defects.py ] && timeout 300 python3 benchmarks/check_gpu_defects.py 2>&1 \
        | tee "$OUT/checks.log" | tail -30 ;;
    graphed) timeout 100 python3 benchmarks/profile_step.py --graphed 2>&1 | tee "$OUT/graphed.log" | grep "us/step" ;;
    dact)  # the fused activation backward's launch shapes (the MLP's 16384x4096 GELU)
      timeout 200 python3 benchmarks/tune_dact_dbias.py 2>&1 | tee "$OUT/dact.log" | tail -16 ;;
    hostcost)  # host cost per call with the GPU kept busy: primitives, the MLP-shaped Linear, a tiny GPT's step
      timeout 200 python3 benchmarks/host_cost.py 2>&1 | tee "$OUT/hostcost.log" | tail -40 ;;
    host) [ -f benchmarks/host_overhead.py ] && timeout 120 python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host.log" | tail -20 ;;
    attn)  # flash attention: its tests (CPU sizes compiled, then T=1000/4096), then beside torch SDPA bf16 with the launch-shape sweep
      timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_attention_kernels.py 2>&1 | tee "$OUT/attn_tests.log" | tail -15
      timeout 260 python3 benchmarks/bench_attention.py --sweep 2>&1 | tee "$OUT/attn.log" | tail -70 ;;
    attnhopper)  # the Hopper attention forwards (attention_kernels.cu FP8, attention_hp_kernels.cu bf16/fp16): the
      # extension built, their tests (the isolating ones first; a short limit each, should a barrier never
      # complete), then beside Triton's, cuDNN's and SDPA's
      timeout 300 python3 -c "from te_fuser.kernels.cuda import load_extension; load_extension()" 2>&1 | tail -5
      timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_attention_fp8.py 2>&1 | tee "$OUT/attnfp8_tests.log" | tail -15
      timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_attention_hopper.py 2>&1 | tee "$OUT/attnhp_tests.log" | tail -15
      timeout 240 python3 benchmarks/bench_attention.py --cases ${ATTN_CASES:-main d64 gqa gpt} 2>&1 | tee "$OUT/attnhopper.log" | tail -60 ;;
    stages)  # the Hopper backward's stages in its dk / dv kernel (set_hopper_backward_stages): the extension built,
      # the same-bits tests first (a short limit: a claim or a flag that never came would hang), then every form
      # timed beside SDPA's and Triton's backwards
      timeout 300 python3 -c "from te_fuser.kernels.cuda import load_extension; load_extension()" 2>&1 | tail -5
      timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_attention_hopper.py -k stages 2>&1 \
        | tee "$OUT/stages_tests.log" | tail -6
      timeout 240 python3 benchmarks/bench_attention.py --cases ${ATTN_CASES:-main d64 gpt} 2>&1 | tee "$OUT/stages.log" \
        | grep -E "bwd" | tail -40 ;;
    stagesab|fwdab)  # in turns, rounds of each (medians): the backward's stages and cuDNN's backward (the bits
      # checked), or (fwdab) the FP8 and bf16 forwards and cuDNN's bf16 forward
      # (FWD_SCHEDULES=1: the FP8 forward under each schedule and the V rewrite alone too)
      timeout 300 python3 -c "from te_fuser.kernels.cuda import load_extension; load_extension()" 2>&1 | tail -5
      timeout 400 python3 benchmarks/stages_ab.py ${STAGES_CASES:+--cases $STAGES_CASES} \
        $([ "$part" = fwdab ] && echo --forward ${FWD_SCHEDULES:+--schedules}) 2>&1 | tee "$OUT/$part.log" | tail -40 ;;
    attnsweep)  # every Triton attention kernel's launch shapes at the main case (the forwards' one-loop shapes
      # and the dk / dv kernel's since its one loop among them): what ATTENTION_PLANS should hold
      timeout 400 python3 benchmarks/bench_attention.py --cases main --sweep --sweep-kernels fwd fwd_fp8 dq dkdv 2>&1 \
        | tee "$OUT/attnsweep.log" | tail -40 ;;
    fp8attn)  # the Hopper FP8 attention forward as the cuda backend's and the auto table's (overlapped schedule by
      # default): the extension built, its tests and the op's and the GPT's attention tests on it, then the forwards
      # side by side
      timeout 300 python3 -c "from te_fuser.kernels.cuda import load_extension; load_extension()" 2>&1 | tail -5
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_attention_fp8.py tests/test_cuda_attention.py \
        2>&1 | tee "$OUT/fp8attn_tests.log" | tail -8
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_op.py tests/test_gpt_attention_ops.py \
        2>&1 | tee -a "$OUT/fp8attn_tests.log" | tail -8
      timeout 150 python3 benchmarks/bench_attention.py --cases ${ATTN_CASES:-main gpt} 2>&1 | tee "$OUT/fp8attn.log" \
        | grep -E "fwd|bwd" | tail -30 ;;
    attngpt)  # the attention backward's launch shapes at the GPT's shape (B 16, 16 heads, seq 1024, head dim 64, causal)
      timeout 250 python3 benchmarks/bench_attention.py --cases gpt --sweep --sweep-case gpt --sweep-kernels dq dkdv \
        2>&1 | tee "$OUT/attngpt.log" | tail -30 ;;
    launches)  # kernels and memsets per call of each GEMM and cast entry at the GPT's shapes
      timeout 200 python3 benchmarks/count_launches.py ${LAUNCH_CANDIDATES:+--candidates $LAUNCH_CANDIDATES} 2>&1 | tee "$OUT/launches.log" | tail -24 ;;
    norm)  # LayerNorm / RMSNorm: the kernels' tests at the GPT's sizes, the backends side by side, the op beside torch
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_norm.py 2>&1 | tee "$OUT/norm_tests.log" | tail -4
      timeout 150 python3 benchmarks/bench_norm.py 2>&1 | tee "$OUT/norm.log" | tail -24 ;;
    grouped)  # GroupedLinear's grouped FP8 GEMMs: their tests (MoE sizes on the GPU), then beside a loop of GEMMs and bf16
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_grouped_gemm_kernel.py tests/test_grouped_linear.py \
        2>&1 | tee "$OUT/grouped_tests.log" | tail -12
      timeout 140 python3 benchmarks/bench_grouped_gemm.py 2>&1 | tee "$OUT/grouped.log" | tail -30 ;;
    *) echo "unknown part: $part" ;;
  esac
done
cp benchmarks/out/results.csv "$OUT/" 2>/dev/null || true  # record it here: python benchmarks/harness.py --record
