"""What the engine is and does, as the supervising process sees it: spawn and stop the children,
watch them, restart them, dump a crash; `EngineMonitor` is the one writer of engine state."""
