// PLACEHOLDER: op tests of the CUDA backend against the CPU backend, written with the ops they cover.
#include <gtest/gtest.h>
