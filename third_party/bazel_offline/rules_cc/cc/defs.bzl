"""Offline stand-in for @rules_cc//cc:defs.bzl as Bazel 4.2 uses it.

Bazel 4's own @bazel_tools//tools/cpp BUILD files (the C++ toolchain autoconfiguration) load
@rules_cc//cc:defs.bzl, which Bazel's built-in WORKSPACE suffix declares as an http_archive from
GitHub. In Bazel 4 those rules are thin wrappers over the native ones, which is all this file
re-exports, so the C++ toolchain configures without a download.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
