"""Several tokenizer workers (`--tokenizer-worker-num` > 1): the hub (main process), the fleet of
worker processes, one worker, and a worker's line to the hub."""
