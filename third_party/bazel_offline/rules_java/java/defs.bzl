"""Offline stand-in for @rules_java//java:defs.bzl as Bazel 4.2 uses it.

Bazel 4 registers @bazel_tools//tools/jdk:all as toolchains in every workspace; that package loads
@rules_java//java:defs.bzl, which Bazel's built-in WORKSPACE suffix declares as an http_archive
from GitHub. Nothing here builds Java; this file re-exports the native rules (all Bazel 4's
rules_java does) so toolchain resolution can parse that package without a download.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)

def java_lite_proto_library(**attrs):
    native.java_lite_proto_library(**attrs)

def java_package_configuration(**attrs):
    native.java_package_configuration(**attrs)
