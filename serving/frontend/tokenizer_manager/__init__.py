"""Between HTTP and the engine: the TokenizerManager, one `ReqState` per request, tokenization,
admission (429), the choice of engine rank, and the ZMQ transport."""
