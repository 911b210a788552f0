"""The HTTP (tokenizer) process: the middleware on SGLang's FastAPI app, the ``meta_info`` hook
and the ``kvshare_*`` metrics. Imports nothing of the scheduler process's packages."""
