"""Kernels as bytes: the registry of specialisations, their sources, NVRTC and the disk cache.
Nothing here touches an array or a device, so it runs on build machines without a GPU."""
