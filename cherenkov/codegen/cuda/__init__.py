"""CUDA C++ emitters: one module per concern (async copies, swizzled addressing, ldmatrix,
mma, online softmax, the cp.async pipeline), composed by one module per kernel family."""
