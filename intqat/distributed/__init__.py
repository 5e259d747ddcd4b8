"""intqat under sharded training (FSDP2 `fully_shard`, Lightning's ModelParallelStrategy)."""
