// hyspec._native: the worker boundary between hyspec's Python policy and llama.cpp.
#include "context.h"
#include "errors.h"
#include "model.h"
#include "sampler.h"

#include <pybind11/pybind11.h>

#include <fstream>
#include <map>

namespace py = pybind11;

namespace hyspec {
namespace {

const std::map<std::string, llama_ftype> & quant_types() {
    static const std::map<std::string, llama_ftype> types = {
        {"f32", LLAMA_FTYPE_ALL_F32},        {"f16", LLAMA_FTYPE_MOSTLY_F16},
        {"bf16", LLAMA_FTYPE_MOSTLY_BF16},   {"q8_0", LLAMA_FTYPE_MOSTLY_Q8_0},
        {"q6_k", LLAMA_FTYPE_MOSTLY_Q6_K},   {"q5_0", LLAMA_FTYPE_MOSTLY_Q5_0},
        {"q5_1", LLAMA_FTYPE_MOSTLY_Q5_1},   {"q5_k_m", LLAMA_FTYPE_MOSTLY_Q5_K_M},
        {"q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},   {"q4_1", LLAMA_FTYPE_MOSTLY_Q4_1},
        {"q4_k_m", LLAMA_FTYPE_MOSTLY_Q4_K_M},
    };
    return types;
}

void quantize(const std::string & src, const std::string & dst, const std::string & type, int nthread) {
    const auto & types = quant_types();
    auto it = types.find(type);
    if (it == types.end()) {
        std::string names;
        for (const auto & kv : types) names += (names.empty() ? "" : ", ") + kv.first;
        throw InvalidArgumentError("unknown quantization type '" + type + "'; use one of: " + names);
    }
    if (!std::ifstream(src, std::ios::binary)) throw ModelLoadError("cannot open '" + src + "'");
    llama_model_quantize_params params = llama_model_quantize_default_params();
    params.ftype = it->second;
    params.nthread = nthread;
    clear_last_log_error();
    uint32_t rc;
    {
        py::gil_scoped_release release;
        rc = llama_model_quantize(src.c_str(), dst.c_str(), &params);
    }
    if (rc != 0) throw QuantizeError(with_llama_reason("quantizing '" + src + "' to " + type + " failed"));
}

}  // namespace
}  // namespace hyspec

PYBIND11_MODULE(_native, m) {
    m.doc() = "hyspec's thin, strict binding of llama.cpp (see _native.pyi).";
    llama_backend_init();
    hyspec::install_log_hook();
    hyspec::register_errors(m);
    hyspec::bind_model(m);
    hyspec::bind_context(m);
    hyspec::bind_sampler(m);
    m.def("quantize", &hyspec::quantize, py::arg("src"), py::arg("dst"), py::arg("type"), py::arg("nthread") = 0,
          "Write a quantized copy of a GGUF (type: q8_0, q4_0, f16, ...). Raises QuantizeError.");
    m.def("set_log_level", [](const std::string & level) {
        static const std::map<std::string, int> levels = {
            {"debug", 0}, {"info", 1}, {"warn", 2}, {"warning", 2}, {"error", 3}, {"none", 4}};
        auto it = levels.find(level);
        if (it == levels.end()) throw hyspec::InvalidArgumentError("log level must be debug, info, warn, error or none");
        hyspec::set_log_threshold(it->second);
    }, py::arg("level"),
          "Which llama.cpp log messages are passed on, to the handler or stderr (default: none; errors still go "
          "into exceptions).");
    m.def("set_log_handler", &hyspec::set_log_handler, py::arg("handler"),
          "handler(level, message) receives every whole llama.cpp log message at or above set_log_level's "
          "threshold (level 0 debug, 1 info, 2 warn, 3 error; no trailing newline), from whichever thread "
          "logs, with the GIL held; None sends them to stderr again.");
    m.def("cancel_loads", &hyspec::cancel_loads,
          "Make every Model load in progress in this process stop at its next progress step and raise "
          "ModelLoadError (loads started afterwards are not affected).");
    // Python objects must not be called once the interpreter starts tearing down.
    py::module_::import("atexit").attr("register")(py::cpp_function([] { hyspec::set_log_handler(py::none()); }));
    m.def("system_info", [] { return std::string(llama_print_system_info()); });
    m.def("max_parallel_sequences", [] { return llama_max_parallel_sequences(); });
    m.def("supports_gpu_offload", [] { return llama_supports_gpu_offload(); });
}
