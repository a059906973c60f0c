"""Running a plan: shard tasks, the executors that run them, each task's program, the shard writer."""
