"""gpusched scheduler: keeps cluster state, places requests on GPUs, emits placements."""
