"""The thin runtime: device headers (include/mokgen/*.cuh) and the host side that loads cubins,
owns buffers and launches. It knows nothing of plans or passes: it gets plain sizes."""
