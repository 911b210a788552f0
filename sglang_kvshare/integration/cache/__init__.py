"""The KV cache: the ``kvshare`` radix-cache backend and K/V reads and writes in SGLang's pool."""
