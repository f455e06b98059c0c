// pybind11 entry point for spectool._native (the n-gram corpus lands here).
#include <pybind11/pybind11.h>

PYBIND11_MODULE(_native, m) { m.doc() = "spectool native extension"; }
