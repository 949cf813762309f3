"""Pipeline parallelism in the strategy: the chunk modules of this rank (`chunks`), one step of the schedule run by
`torch.distributed.pipelining` (`step`), and its picture (`timeline`). Where the cut falls is
`lit3d.parallel.stages`."""
