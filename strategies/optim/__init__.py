"""How a split model's optimizer steps: each optimizer's step and clipping (`steps`, `grad_norm`), ZeRO-1 on plain
tensors (`zero1`, its buckets and per-parameter slices), the dtypes a run computes and reduces in (`dtypes`), and
DiLoCo's outer step across islands (`diloco`)."""
