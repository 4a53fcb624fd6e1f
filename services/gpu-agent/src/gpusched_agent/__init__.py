"""gpusched GPU agent: reports a node's GPUs, executes placed requests, meters usage."""
