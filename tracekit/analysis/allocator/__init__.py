"""A model of PyTorch's CUDA caching allocator, its replay of a trace, and what-ifs on its settings."""
