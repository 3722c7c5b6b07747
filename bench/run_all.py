"""Run every benchmark and print its ratios: ``python bench/run_all.py``."""

import bench_checkpoint
import bench_cluster
import bench_comm_hooks
import bench_elastic
import bench_exactly_once
import bench_launch
import bench_llm
import bench_metrics
import bench_object_storage
import bench_roundtrip
import bench_step_time

if __name__ == "__main__":
    for bench in (bench_roundtrip, bench_launch, bench_step_time, bench_metrics, bench_checkpoint,
                  bench_object_storage, bench_elastic,
                  bench_exactly_once, bench_comm_hooks, bench_llm, bench_cluster):
        bench.main()
