"""The main process: HTTP (`http/`), the TokenizerManager (`tokenizer_manager/`), the engine's
supervision (`supervision/`) and, with several tokenizer workers, the hub and its workers
(`workers/`); `stack.FrontEnd` assembles one front end, `launch` starts the server."""
