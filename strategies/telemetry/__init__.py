"""What a run measures of itself: the bytes each rank sends (`comm`), the bytes it holds (`held_memory`) and its peak
of live tensors (`live_memory`), and the check of both against the planner's estimate (`plan_check`)."""
