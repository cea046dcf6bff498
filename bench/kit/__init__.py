"""The kit every bench script stands on; each piece exists once, here or (what ``elmo bench`` shares) in the
installed elmo.bench.figures:

- bench.kit.serve: ``elmo serve`` as a child process, one (start_server) or N replicas (start_replicas), of this
  checkout or a revision's tree; Server (ports, readiness, stop)
- bench.kit.revision: revision_tree / code_trees (``--before REV`` worktrees), in_turn, tree_env, revision_info
- bench.kit.load: the gRPC load loop (drive: throughput in a measured window), ClosedLoop (client threads whose
  every call is kept: replicas), requests built up front, Http, the in-process baseline (measure_in_process),
  LoadResult
- bench.kit.sample: RSS, peak memory (VmHWM), CPU time of a process or thread; ThreadCpuSampler; run_measured (a
  child command's wall time, peak RSS and CPU time)
- bench.kit.texts: make_texts, sentences (real English), corpus_lines
- bench.kit.models: prepare_model (--model or a random-weights --preset)
- bench.kit.isa: a command run as on an AVX2 CPU (AVX-512, VNNI, AMX hidden from CPUID: cpuid_mask.c), avx2_env
- bench.kit.results: bench/results/ (RESULTS, result_path), write_json, save_result, pyplot, bench_parser
- elmo.bench.figures (installed): percentiles / percentiles_ms, machine (elmo.runtime.host), load_average
"""
