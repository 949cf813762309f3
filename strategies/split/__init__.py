"""How a network is split across ranks, one file per way: tensor parallelism (`tensor_parallel`), context
parallelism (`context_parallel`), data parallelism with ZeRO 2-3 on FSDP2 (`data_parallel`), FP8 linears (`float8`),
activation recompute (`recompute`), and the split counted for `lit3d plan --verify` (`count`). The order in which
they apply is one function: `lit3d.strategies.parallelize`."""
