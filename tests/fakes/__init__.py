"""Fakes of libraries that need hardware this project's CI lacks (CUDA, TensorRT, NVML). Each
holds the real library's contract: the same names, argument types, return shapes and refusals,
so code that passes against a fake calls the real library correctly. `install` puts them where
`import` finds them."""
