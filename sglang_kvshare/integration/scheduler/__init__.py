"""The scheduler process: segment-wise prefill, the sharing families, request release,
ReBaseShared's double batching and own LR column, and the anchor pool file."""
