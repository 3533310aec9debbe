"""Host-side runtime: requests, pages, prefix cache, scheduler, batcher. Imports no JAX."""
