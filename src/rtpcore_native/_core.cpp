// rtpcore_native._core: the KV-cache spec builder (filled in by the KV-spec work).
#include <pybind11/pybind11.h>

namespace py = pybind11;

#ifndef RTPCORE_NATIVE_VERSION
#define RTPCORE_NATIVE_VERSION "dev"
#endif

PYBIND11_MODULE(_core, m) {
    m.doc() = "rtpcore native core: KV-cache spec builder";
    m.attr("__version__") = RTPCORE_NATIVE_VERSION;
}
