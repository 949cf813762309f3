"""A rank's life: starting the ranks (`launchers`), ending the job when one fails or hangs (`watchdog`), stopping
every rank at one step on a scheduler's signal (`preemption`), and the threads a fit starts and stops (`rank_life`)."""
