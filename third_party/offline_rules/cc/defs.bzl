"""Offline stand-in for @rules_cc//cc:defs.bzl: Bazel's native C++ rules."""

cc_binary = native.cc_binary
cc_library = native.cc_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
