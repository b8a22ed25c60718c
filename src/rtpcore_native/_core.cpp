// rtpcore_native._core: the KV-cache spec builder.
//
// A KVCacheSpecDesc says what one attention layer caches (kind, dtype, sizes,
// layout name); build_kv_cache_spec turns it into a KVCacheSpec: the byte map
// of one token's row (regions), its k/v/scale partition and the block size.
// Plain ints and strings cross the boundary. Every invalid input throws
// std::invalid_argument naming the field and the value (Python: ValueError),
// and every size is computed with overflow-checked int64 arithmetic.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

#ifndef RTPCORE_NATIVE_VERSION
#define RTPCORE_NATIVE_VERSION "dev"
#endif

namespace {

constexpr int64_t kMaxDim = 2147483647;  // 2**31 - 1: the largest size any field may take
constexpr int64_t kPaddedGroup = 128;     // "padded": one fp32 scale per 128 nope values

// The one dtype-size table. fp8_e8m0 is a scale format: valid in regions, never as a KV dtype.
const std::vector<std::pair<std::string, int64_t>> kDtypeSizes = {
    {"fp32", 4}, {"fp16", 2}, {"bf16", 2}, {"fp8_e4m3", 1}, {"fp8_e8m0", 1}};
const char* const kKvDtypes = "'fp32', 'fp16', 'bf16', 'fp8_e4m3'";
const char* const kBuiltinLayouts[] = {"compact", "padded"};

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string quoted(const std::string& s) { return "'" + s + "'"; }

// In the helpers below, `what` is a callable returning the message prefix; it runs only on failure.
template <typename What>
int64_t dtype_size(const std::string& dtype, const What& what) {
    for (const auto& entry : kDtypeSizes)
        if (entry.first == dtype) return entry.second;
    fail(what() + " has unknown dtype " + quoted(dtype) + " (known: " + kKvDtypes + ", 'fp8_e8m0')");
}

template <typename What>
int64_t checked_mul(int64_t a, int64_t b, const What& what) {
    if (a < 0 || b < 0) fail(what() + ": negative operand " + std::to_string(a) + " x " + std::to_string(b));
    if (a != 0 && b > std::numeric_limits<int64_t>::max() / a)
        fail(what() + " = " + std::to_string(a) + " x " + std::to_string(b) + " overflows int64");
    return a * b;
}

template <typename What>
int64_t checked_add(int64_t a, int64_t b, const What& what) {
    if (a < 0 || b < 0) fail(what() + ": negative operand " + std::to_string(a) + " + " + std::to_string(b));
    if (b > std::numeric_limits<int64_t>::max() - a)
        fail(what() + " = " + std::to_string(a) + " + " + std::to_string(b) + " overflows int64");
    return a + b;
}

// A Python int -> int64, refusing bools and anything outside int64 with a ValueError.
int64_t to_int64(const py::int_& value, const char* field) {
    if (PyBool_Check(value.ptr())) fail(std::string(field) + " must be an int, got a bool");
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow != 0) fail(std::string(field) + "=" + py::str(value).cast<std::string>() + " does not fit in int64");
    return static_cast<int64_t>(v);
}

struct Region {
    std::string name;
    int64_t offset;
    int64_t nbytes;
    std::string dtype;
};
using RegionTuple = std::tuple<std::string, int64_t, int64_t, std::string>;
using RegionRequest = std::tuple<std::string, std::string, int64_t>;  // (name, dtype, element_count)

}  // namespace

// ---------------------------------------------------------------- descriptor

struct KVCacheSpecDesc {
    std::string tag, kind, dtype;
    int64_t kv_lora_rank = 0, rope_head_dim = 0, num_kv_heads = 0, head_dim = 0;
    int64_t tokens_per_block = 16;
    std::string layout;

    std::string where() const { return "KVCacheSpecDesc(tag=" + quoted(tag) + ")"; }

    void check_dim(int64_t value, const char* field, bool used) const {
        auto f = [&] { return where() + "." + field; };
        if (!used && value != 0) fail(f() + "=" + std::to_string(value) + " does not apply to kind=" + quoted(kind));
        if (used && value <= 0) fail(f() + " must be a positive integer, got " + std::to_string(value));
        if (value > kMaxDim) fail(f() + "=" + std::to_string(value) + " exceeds the limit 2**31-1");
    }

    void validate() const {
        if (tag.empty()) fail("KVCacheSpecDesc.tag must be a non-empty string, got ''");
        if (kind != "mha" && kind != "mla")
            fail(where() + ".kind must be 'mha' or 'mla', got " + quoted(kind));
        if (dtype == "fp8_e8m0")
            fail(where() + ".dtype='fp8_e8m0' is a scale format only; KV dtypes: " + kKvDtypes);
        if (dtype != "fp32" && dtype != "fp16" && dtype != "bf16" && dtype != "fp8_e4m3")
            fail(where() + ".dtype must be one of " + kKvDtypes + ", got " + quoted(dtype));
        bool mla = kind == "mla";
        check_dim(kv_lora_rank, "kv_lora_rank", mla);
        check_dim(rope_head_dim, "rope_head_dim", mla);
        check_dim(num_kv_heads, "num_kv_heads", !mla);
        check_dim(head_dim, "head_dim", !mla);
        check_dim(tokens_per_block, "tokens_per_block", true);
    }
};

// ---------------------------------------------------------------- layout policies

// An fp8 MLA layout: named regions in storage order, packed without padding.
class Fp8LayoutPolicy {
public:
    virtual ~Fp8LayoutPolicy() = default;
    // The layout's name; a Python subclass sets a ``name`` class attribute instead.
    virtual std::string name() const { return name_; }
    virtual std::vector<RegionRequest> regions(int64_t kv_lora_rank, int64_t rope_head_dim) const = 0;
    std::string base_name() const { return name_; }

protected:
    std::string name_;
};

class PaddedLayout final : public Fp8LayoutPolicy {
public:
    PaddedLayout() { name_ = "padded"; }
    std::vector<RegionRequest> regions(int64_t rank, int64_t rope) const override {
        if (rank % kPaddedGroup != 0)
            fail("kv_lora_rank=" + std::to_string(rank) +
                 " must be divisible by 128 for layout 'padded' (one fp32 scale per 128 values)");
        return {{"nope", "fp8_e4m3", rank}, {"nope_scale", "fp32", rank / kPaddedGroup}, {"rope", "bf16", rope}};
    }
};

class CompactLayout final : public Fp8LayoutPolicy {
public:
    CompactLayout() { name_ = "compact"; }
    std::vector<RegionRequest> regions(int64_t rank, int64_t rope) const override {
        return {{"nope", "fp8_e4m3", rank}, {"rope", "fp8_e4m3", rope}};
    }
};

// Python subclasses: ``name`` is read as an attribute, ``regions`` is called and its
// result validated here, so a policy returning garbage gives ValueError, not a cast error.
class PyFp8LayoutPolicy : public Fp8LayoutPolicy {
public:
    std::string name() const override {
        py::gil_scoped_acquire gil;
        py::object self = py::cast(static_cast<const Fp8LayoutPolicy*>(this), py::return_value_policy::reference);
        py::object value = py::getattr(self, "name", py::none());
        if (!py::isinstance<py::str>(value) || value.cast<std::string>().empty())
            fail("Fp8LayoutPolicy subclass " + quoted(py::str(py::type::of(self).attr("__qualname__"))) +
                 " needs a non-empty str 'name', got " + py::repr(value).cast<std::string>());
        return value.cast<std::string>();
    }

    std::vector<RegionRequest> regions(int64_t rank, int64_t rope) const override {
        py::gil_scoped_acquire gil;
        py::function override = py::get_override(static_cast<const Fp8LayoutPolicy*>(this), "regions");
        std::string where = "layout " + quoted(name()) + ": regions()";
        if (!override) fail(where + " is not implemented");
        py::object result = override(rank, rope);
        if (!py::isinstance<py::list>(result) && !py::isinstance<py::tuple>(result))
            fail(where + " must return a list of (name, dtype, element_count), got " + py::repr(result).cast<std::string>());
        std::vector<RegionRequest> out;
        for (py::handle item : result) {
            bool ok = (py::isinstance<py::tuple>(item) || py::isinstance<py::list>(item)) && py::len(item) == 3;
            if (ok) {
                py::sequence t = py::reinterpret_borrow<py::sequence>(item);
                ok = py::isinstance<py::str>(t[0]) && py::isinstance<py::str>(t[1]) &&
                     py::isinstance<py::int_>(t[2]) && !PyBool_Check(py::object(t[2]).ptr());
                if (ok) {
                    out.emplace_back(py::object(t[0]).cast<std::string>(), py::object(t[1]).cast<std::string>(),
                                     to_int64(py::object(t[2]), "element_count"));
                    continue;
                }
            }
            fail(where + " returned an entry that is not (name: str, dtype: str, element_count: int): " +
                 py::repr(item).cast<std::string>());
        }
        return out;
    }
};

// ---------------------------------------------------------------- spec

struct KVCacheSpec {
    KVCacheSpecDesc desc;  // layout holds the resolved name ("" where no fp8 MLA layout applies)
    std::vector<Region> regions;
    int64_t bytes_per_token = 0, block_bytes = 0, k_block_bytes = 0, v_block_bytes = 0, scale_block_bytes = 0;

    // Lay the requested regions out back to back and derive the partition.
    void place(const std::vector<RegionRequest>& requests) {
        auto w = [this] { return desc.where(); };
        const bool mla = desc.kind == "mla";
        const std::string k_name = mla ? "nope" : "k", v_name = mla ? "rope" : "v";
        const int64_t k_count = mla ? desc.kv_lora_rank : checked_mul(desc.num_kv_heads, desc.head_dim, [&] { return w() + " k elements"; });
        const int64_t v_count = mla ? desc.rope_head_dim : k_count;
        int64_t offset = 0, k_bytes = -1, v_bytes = -1, scale_bytes = 0;
        regions.clear();
        for (const auto& request : requests) {
            const std::string& name = std::get<0>(request);
            const std::string& dtype = std::get<1>(request);
            const int64_t count = std::get<2>(request);
            auto rw = [&] { return w() + " region " + quoted(name); };
            if (name.empty()) fail(w() + ": a region has an empty name");
            for (const auto& r : regions)
                if (r.name == name) fail(rw() + " appears twice");
            int64_t size = dtype_size(dtype, rw);
            if (count <= 0 || count > kMaxDim)
                fail(rw() + " element_count must be in 1..2**31-1, got " + std::to_string(count));
            int64_t nbytes = checked_mul(count, size, [&] { return rw() + " nbytes"; });
            if (name == k_name || name == v_name) {
                int64_t want = name == k_name ? k_count : v_count;
                if (dtype == "fp8_e8m0") fail(rw() + " cannot hold values as 'fp8_e8m0' (a scale format)");
                if (count != want)
                    fail(rw() + " must hold " + std::to_string(want) + " elements, got " + std::to_string(count));
                (name == k_name ? k_bytes : v_bytes) = nbytes;
            } else {
                scale_bytes = checked_add(scale_bytes, nbytes, [&] { return w() + " scale bytes"; });
            }
            regions.push_back({name, offset, nbytes, dtype});
            offset = checked_add(offset, nbytes, [&] { return w() + " bytes_per_token"; });
        }
        if (k_bytes < 0) fail(w() + ": layout " + quoted(desc.layout) + " has no " + quoted(k_name) + " region");
        if (v_bytes < 0) fail(w() + ": layout " + quoted(desc.layout) + " has no " + quoted(v_name) + " region");
        const int64_t t = desc.tokens_per_block;
        bytes_per_token = offset;
        block_bytes = checked_mul(offset, t, [&] { return w() + " block_bytes (bytes_per_token x tokens_per_block)"; });
        k_block_bytes = checked_mul(k_bytes, t, [&] { return w() + " k_block_bytes"; });
        v_block_bytes = checked_mul(v_bytes, t, [&] { return w() + " v_block_bytes"; });
        scale_block_bytes = checked_mul(scale_bytes, t, [&] { return w() + " scale_block_bytes"; });
        if (k_block_bytes + v_block_bytes + scale_block_bytes != block_bytes)  // cannot happen: sums of checked parts
            throw std::logic_error("internal error: k + v + scale != block");
    }

    std::vector<RegionTuple> region_tuples() const {
        std::vector<RegionTuple> out;
        for (const auto& r : regions) out.emplace_back(r.name, r.offset, r.nbytes, r.dtype);
        return out;
    }
};

namespace {

KVCacheSpec build(const KVCacheSpecDesc& desc, const Fp8LayoutPolicy* policy) {
    desc.validate();
    KVCacheSpec spec;
    spec.desc = desc;
    auto w = [&desc] { return desc.where(); };
    const bool fp8_mla = desc.kind == "mla" && desc.dtype == "fp8_e4m3";
    if (policy != nullptr && !fp8_mla)
        fail(w() + ": a layout policy applies only to kind='mla' with dtype='fp8_e4m3', got kind=" +
             quoted(desc.kind) + " dtype=" + quoted(desc.dtype));
    std::vector<RegionRequest> requests;
    if (!fp8_mla) {
        spec.desc.layout = "";
        if (desc.kind == "mla") {
            requests = {{"nope", desc.dtype, desc.kv_lora_rank}, {"rope", desc.dtype, desc.rope_head_dim}};
        } else {
            int64_t n = checked_mul(desc.num_kv_heads, desc.head_dim, [&] { return w() + " num_kv_heads x head_dim"; });
            requests = {{"k", desc.dtype, n}, {"v", desc.dtype, n}};
            if (desc.dtype == "fp8_e4m3")  // one fp32 scale per token per head, for K and for V
                requests.insert(requests.end(), {{"k_scale", "fp32", desc.num_kv_heads}, {"v_scale", "fp32", desc.num_kv_heads}});
        }
    } else {
        static const PaddedLayout padded;
        static const CompactLayout compact;
        if (policy == nullptr) {  // a built-in layout, by name; "" means "padded"
            if (desc.layout.empty() || desc.layout == "padded") policy = &padded;
            else if (desc.layout == "compact") policy = &compact;
            else fail(w() + ".layout=" + quoted(desc.layout) + " is unknown (built-in: 'compact', 'padded'; a plugin layout is passed as policy=)");
        }
        std::string name = policy->name();
        if (!desc.layout.empty() && desc.layout != name)
            fail(w() + ".layout=" + quoted(desc.layout) + " does not match the policy's name " + quoted(name));
        spec.desc.layout = name;
        try {
            requests = policy->regions(desc.kv_lora_rank, desc.rope_head_dim);
        } catch (const std::invalid_argument& e) {
            fail(w() + ": " + e.what());
        }
    }
    spec.place(requests);
    return spec;
}

int64_t plan_blocks(const std::vector<const KVCacheSpec*>& specs, const py::int_& memory_bytes) {
    int64_t memory = to_int64(memory_bytes, "memory_bytes");
    if (memory < 0) fail("memory_bytes must be >= 0, got " + std::to_string(memory));
    if (specs.empty()) fail("specs must name at least one layer, got an empty list");
    int64_t per_block = 0;
    for (const KVCacheSpec* s : specs) {
        if (s == nullptr) fail("specs must hold KVCacheSpec objects, got None");
        per_block = checked_add(per_block, s->block_bytes, [] { return std::string("sum of block_bytes over layers"); });
    }
    return memory / per_block;
}

std::string spec_repr(const KVCacheSpec& s) {
    return "KVCacheSpec(tag=" + quoted(s.desc.tag) + ", kind=" + quoted(s.desc.kind) + ", dtype=" +
           quoted(s.desc.dtype) + ", layout=" + quoted(s.desc.layout) + ", bytes_per_token=" +
           std::to_string(s.bytes_per_token) + ", block_bytes=" + std::to_string(s.block_bytes) + ")";
}

std::string desc_repr(const KVCacheSpecDesc& d) {
    std::string dims = d.kind == "mla" ? "kv_lora_rank=" + std::to_string(d.kv_lora_rank) +
                                             ", rope_head_dim=" + std::to_string(d.rope_head_dim)
                                       : "num_kv_heads=" + std::to_string(d.num_kv_heads) +
                                             ", head_dim=" + std::to_string(d.head_dim);
    return "KVCacheSpecDesc(tag=" + quoted(d.tag) + ", kind=" + quoted(d.kind) + ", dtype=" + quoted(d.dtype) +
           ", " + dims + ", tokens_per_block=" + std::to_string(d.tokens_per_block) + ", layout=" +
           quoted(d.layout) + ")";
}

py::tuple desc_state(const KVCacheSpecDesc& d) {
    return py::make_tuple(d.tag, d.kind, d.dtype, d.kv_lora_rank, d.rope_head_dim, d.num_kv_heads, d.head_dim,
                          d.tokens_per_block, d.layout);
}

KVCacheSpecDesc desc_from_state(const py::tuple& t) {
    if (t.size() != 9) fail("KVCacheSpecDesc state must have 9 fields, got " + std::to_string(t.size()));
    KVCacheSpecDesc d{t[0].cast<std::string>(), t[1].cast<std::string>(), t[2].cast<std::string>(),
                      t[3].cast<int64_t>(),     t[4].cast<int64_t>(),     t[5].cast<int64_t>(),
                      t[6].cast<int64_t>(),     t[7].cast<int64_t>(),     t[8].cast<std::string>()};
    d.validate();
    return d;
}

bool same_desc(const KVCacheSpecDesc& a, const KVCacheSpecDesc& b) {
    return desc_state(a).equal(desc_state(b));
}

}  // namespace

// ---------------------------------------------------------------- bindings

// The descriptor's fields, readable on a KVCacheSpecDesc and on a KVCacheSpec alike.
template <typename T>
void def_desc_fields(py::class_<T>& cls, const KVCacheSpecDesc& (*get)(const T&)) {
    cls.def_property_readonly("tag", [get](const T& o) { return get(o).tag; })
        .def_property_readonly("kind", [get](const T& o) { return get(o).kind; })
        .def_property_readonly("dtype", [get](const T& o) { return get(o).dtype; })
        .def_property_readonly("kv_lora_rank", [get](const T& o) { return get(o).kv_lora_rank; })
        .def_property_readonly("rope_head_dim", [get](const T& o) { return get(o).rope_head_dim; })
        .def_property_readonly("num_kv_heads", [get](const T& o) { return get(o).num_kv_heads; })
        .def_property_readonly("head_dim", [get](const T& o) { return get(o).head_dim; })
        .def_property_readonly("tokens_per_block", [get](const T& o) { return get(o).tokens_per_block; })
        .def_property_readonly("layout", [get](const T& o) { return get(o).layout; });
}

const KVCacheSpecDesc& desc_of(const KVCacheSpecDesc& d) { return d; }
const KVCacheSpecDesc& spec_desc(const KVCacheSpec& s) { return s.desc; }

PYBIND11_MODULE(_core, m) {
    m.doc() = "rtpcore native core: the KV-cache spec builder (sizes, byte regions, block planning)";
    m.attr("__version__") = RTPCORE_NATIVE_VERSION;
    m.attr("BUILTIN_LAYOUTS") = py::make_tuple(kBuiltinLayouts[0], kBuiltinLayouts[1]);

    py::class_<KVCacheSpecDesc> desc_cls(m, "KVCacheSpecDesc",
                                    "What one attention layer caches; immutable. Validated on construction.");
    desc_cls
        .def(py::init([](const std::string& tag, const std::string& kind, const std::string& dtype,
                         const py::int_& kv_lora_rank, const py::int_& rope_head_dim, const py::int_& num_kv_heads,
                         const py::int_& head_dim, const py::int_& tokens_per_block, const std::string& layout) {
                 KVCacheSpecDesc d{tag,
                                   kind,
                                   dtype,
                                   to_int64(kv_lora_rank, "kv_lora_rank"),
                                   to_int64(rope_head_dim, "rope_head_dim"),
                                   to_int64(num_kv_heads, "num_kv_heads"),
                                   to_int64(head_dim, "head_dim"),
                                   to_int64(tokens_per_block, "tokens_per_block"),
                                   layout};
                 d.validate();
                 return d;
             }),
             py::kw_only(), py::arg("tag"), py::arg("kind"), py::arg("dtype"), py::arg("kv_lora_rank") = 0,
             py::arg("rope_head_dim") = 0, py::arg("num_kv_heads") = 0, py::arg("head_dim") = 0,
             py::arg("tokens_per_block") = 16, py::arg("layout") = "")
        .def("__repr__", [](const KVCacheSpecDesc& h) { return desc_repr(h); })
        .def("__eq__", [](const KVCacheSpecDesc& a, const KVCacheSpecDesc& b) { return same_desc(a, b); },
             py::arg("other"))
        .def("__hash__", [](const KVCacheSpecDesc& h) { return py::hash(desc_state(h)); })
        .def(py::pickle([](const KVCacheSpecDesc& h) { return desc_state(h); },
                        [](const py::tuple& t) { return desc_from_state(t); }));
    def_desc_fields(desc_cls, &desc_of);

    py::class_<KVCacheSpec> spec_cls(m, "KVCacheSpec",
                                     "One layer's KV-cache byte layout; built by build_kv_cache_spec.");
    spec_cls.def_readonly("bytes_per_token", &KVCacheSpec::bytes_per_token)
        .def_readonly("block_bytes", &KVCacheSpec::block_bytes)
        .def_readonly("k_block_bytes", &KVCacheSpec::k_block_bytes)
        .def_readonly("v_block_bytes", &KVCacheSpec::v_block_bytes)
        .def_readonly("scale_block_bytes", &KVCacheSpec::scale_block_bytes)
        .def_property_readonly("regions", &KVCacheSpec::region_tuples,
                               "[(name, offset, nbytes, dtype)] inside one token's row, in storage order")
        .def("__repr__", &spec_repr)
        .def("__eq__",
             [](const KVCacheSpec& a, const KVCacheSpec& b) {
                 return same_desc(a.desc, b.desc) && a.region_tuples() == b.region_tuples();
             },
             py::arg("other"))
        .def("__hash__", [](const KVCacheSpec& s) { return py::hash(desc_state(s.desc)); })
        .def(py::pickle(
            [](const KVCacheSpec& s) {
                py::list regions;
                for (const auto& r : s.regions) regions.append(py::make_tuple(r.name, r.dtype, r.nbytes / dtype_size(r.dtype, [] { return std::string("region"); })));
                return py::make_tuple(desc_state(s.desc), regions);
            },
            [](const py::tuple& t) {
                if (t.size() != 2) fail("KVCacheSpec state must have 2 fields, got " + std::to_string(t.size()));
                KVCacheSpec s;
                s.desc = desc_from_state(t[0].cast<py::tuple>());
                s.place(t[1].cast<std::vector<RegionRequest>>());
                return s;
            }));
    def_desc_fields(spec_cls, &spec_desc);

    py::class_<Fp8LayoutPolicy, PyFp8LayoutPolicy>(
        m, "Fp8LayoutPolicy",
        "Base class of an fp8 MLA layout. Subclasses set a ``name`` class attribute and implement\n"
        "``regions(kv_lora_rank, rope_head_dim) -> [(region_name, dtype, element_count), ...]`` in\n"
        "storage order; regions 'nope' and 'rope' are required, every other region is scale.")
        .def(py::init<>())
        .def_property_readonly("name", &Fp8LayoutPolicy::base_name)
        .def("regions", &Fp8LayoutPolicy::regions, py::arg("kv_lora_rank"), py::arg("rope_head_dim"));

    m.def(
        "build_kv_cache_spec",
        [](const KVCacheSpecDesc& desc, const py::object& policy) {
            // py::object rather than a nullable pointer: pybind11's None-to-pointer path costs
            // a swallowed AttributeError per call.
            if (policy.is_none()) return build(desc, nullptr);
            if (!py::isinstance<Fp8LayoutPolicy>(policy))
                throw py::type_error("policy must be an Fp8LayoutPolicy or None, got " +
                                     py::repr(policy).cast<std::string>());
            return build(desc, policy.cast<const Fp8LayoutPolicy*>());
        },
        py::arg("desc"), py::arg("policy") = py::none(),
        "Build one layer's KVCacheSpec; ``policy`` (an Fp8LayoutPolicy) overrides the built-in fp8 MLA layouts.");
    m.def("plan_kv_cache_blocks", &plan_blocks, py::arg("specs"), py::arg("memory_bytes"),
          "How many blocks per layer fit in memory_bytes when every layer holds that many blocks.");
}
