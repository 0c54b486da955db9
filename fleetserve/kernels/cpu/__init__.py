"""CPU kernels: a C++/OpenMP torch extension built with the machine's compiler (`build`)."""
