// Errors raised by engine._C, and how they reach Python.
//
// Why not TORCH_CHECK: a c10::Error captures a native backtrace when it is constructed
// (an unwind walk over every frame up to the interpreter's main), and it then crosses into
// Python through whichever pybind11 exception translators share this module's pybind11
// internals (torch's, Triton's, ...). On a CUDA build a TORCH_CHECK in Arena::free_slot
// killed the process (SIGSEGV) instead of raising, in exactly that path, while the same
// call raised on CPU builds (docs/design-notes.md). Our own checks therefore throw
// pe::Error, a plain std::runtime_error (no backtrace walk), and every binding catches at
// its boundary (csrc/bindings.cpp, `guard`) and sets the Python exception itself, so no
// translator, foreign or ours, ever runs for an exception thrown here.
#pragma once

#include <c10/util/StringUtil.h>

#include <stdexcept>
#include <string>

namespace pe {

// A misuse of engine._C (bad index, freed slot, wrong tensor): RuntimeError in Python.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace pe

// PE_CHECK(cond, parts...): throws pe::Error with the parts joined (c10::str) when cond
// is false. The message is built only on failure.
#define PE_CHECK(cond, ...)                                   \
  do {                                                        \
    if (!(cond)) {                                            \
      throw ::pe::Error(::c10::str(__VA_ARGS__));             \
    }                                                         \
  } while (false)
