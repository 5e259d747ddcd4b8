"""intqat under sharded training (FSDP2 `fully_shard`, Lightning's ModelParallelStrategy): docs/distributed.md.

fsdp         FSDP2's classes in the registry, its state carried across intqat's swaps (imported by the registry)
shards       which Parameters FSDP2 manages; values and gradients of quantizer Parameters under it
int8_gather  the integer stage's int8 all-gather (enable / disable / use_int8_all_gather)
lightning    FullyShardStrategy; distributed checkpoints and the unsharded copy IntQAT needs
metrics      IntQAT's per-layer measurements on sharded layers
traffic      count the bytes FSDP2 all-gathers
launch       run a function on N gloo processes (tests, bench)
bench        python -m intqat.distributed.bench
"""
