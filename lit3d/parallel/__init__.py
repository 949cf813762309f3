"""The pure description of a parallel run: no Lightning, no process group, only arithmetic and rules.

- `lit3d.parallel.layout`: the rank grid (sizes, each rank's coordinate, groups, the rank map) and the checks of
  sizes against a world and a model;
- `lit3d.parallel.schedules`: what each pipeline schedule runs and its theory (bubble, activations in flight);
- `lit3d.parallel.stages`: the depth cut into pipeline chunks (the chunk modules are
  `lit3d.strategies.pipelining.chunks`);
- `lit3d.parallel.sharding`: what tensor parallelism's roles split, and ZeRO-1's bucket size;
- `lit3d.parallel.precision`: which dtypes a run holds and reduces in;
- `lit3d.parallel.context`: context parallelism's sequence split and ring bytes;
- `lit3d.parallel.outer`: DiLoCo's outer-loop settings.

The Lightning strategy (`lit3d.strategies`) and the planner (`lit3d.planner`) both take their rules from here, so
the planner never imports the strategy (nor Lightning), and no rule is written twice.
"""
