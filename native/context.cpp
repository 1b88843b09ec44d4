#include "context.h"

#include "errors.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>
#include <unordered_map>

namespace py = pybind11;

namespace hyspec {
namespace {

using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// obj as a 1-D numpy array whose dtype kind is one of `kinds` ('i' signed, 'u' unsigned, 'b' bool);
// an empty sequence passes whatever its dtype (numpy makes [] float64). Anything else (floats,
// which a cast would silently truncate, strings, 2-D arrays) is an InvalidArgumentError.
py::array checked_array(const py::object & obj, const char * name, const char * kinds, const char * what) {
    py::array arr;
    try {
        arr = py::array::ensure(obj);
    } catch (py::error_already_set &) {
        arr = py::array();
    }
    const std::string message = std::string(name) + " must be a 1-D sequence of " + what;
    if (!arr || arr.ndim() != 1) throw InvalidArgumentError(message);
    if (arr.size() > 0 && std::strchr(kinds, arr.dtype().kind()) == nullptr) {
        throw InvalidArgumentError(message + " (got dtype " + py::str(arr.dtype()).cast<std::string>() + ")");
    }
    return arr;
}

std::vector<int64_t> to_int_vector(const py::object & obj, const char * name) {
    IntArray arr = IntArray::ensure(checked_array(obj, name, "iu", "integers"));
    if (!arr) throw InvalidArgumentError(std::string(name) + " must be a 1-D sequence of integers");
    return std::vector<int64_t>(arr.data(), arr.data() + arr.size());
}

std::vector<bool> to_bool_vector(const py::object & obj, const char * name) {
    using BoolArray = py::array_t<bool, py::array::c_style | py::array::forcecast>;
    BoolArray arr = BoolArray::ensure(checked_array(obj, name, "biu", "bools"));
    if (!arr) throw InvalidArgumentError(std::string(name) + " must be a 1-D sequence of bools");
    return std::vector<bool>(arr.data(), arr.data() + arr.size());
}

// A position for llama.cpp (int32): -1 or below means "open end", as llama.cpp reads it.
llama_pos to_pos(int64_t p, const char * name) {
    if (p < -1 || p > INT32_MAX) {
        throw InvalidArgumentError(std::string(name) + "=" + std::to_string(p) + " is outside [-1, " +
                                   std::to_string(INT32_MAX) + "] (-1: open end)");
    }
    return static_cast<llama_pos>(p);
}

// A llama_batch freed on scope exit.
struct Batch {
    llama_batch batch;
    explicit Batch(int32_t n) : batch(llama_batch_init(n, 0, 1)) {}
    ~Batch() { llama_batch_free(batch); }
};

}  // namespace

Context::Guard::Guard(Context & ctx) : ctx_(ctx) {
    if (!ctx.ctx_) throw ClosedError("Context is closed");
    bool expected = false;
    if (!ctx.busy_.compare_exchange_strong(expected, true)) {
        throw ConcurrentUseError("this Context is in use by another thread; a Context belongs to one worker thread");
    }
}

Context::Guard::~Guard() { ctx_.busy_.store(false); }

Context::Context(const Model & model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch, uint32_t n_seq_max,
                 int32_t n_threads, uint32_t n_rs_seq, bool kv_unified)
    : model_(model) {
    model_.handle();  // raises ClosedError for a closed model
    const uint32_t max_seq = static_cast<uint32_t>(llama_max_parallel_sequences());
    if (n_seq_max < 1 || n_seq_max > max_seq) {
        throw InvalidArgumentError("n_seq_max must be between 1 and " + std::to_string(max_seq));
    }
    if (n_batch < 1) throw InvalidArgumentError("n_batch must be at least 1");
    if (n_ubatch < 1 || n_ubatch > n_batch) throw InvalidArgumentError("n_ubatch must be between 1 and n_batch");
    if (n_threads < 0) throw InvalidArgumentError("n_threads must be >= 0 (0 = all cores)");
    if (n_threads == 0) n_threads = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));

    llama_context_params params = llama_context_default_params();
    params.n_ctx = n_ctx;
    params.n_batch = n_batch;
    params.n_ubatch = n_ubatch;
    params.n_seq_max = n_seq_max;
    params.n_rs_seq = n_rs_seq;
    params.n_threads = n_threads;
    params.n_threads_batch = n_threads;
    params.kv_unified = kv_unified;
    params.no_perf = true;
    clear_last_log_error();
    {
        py::gil_scoped_release release;
        ctx_ = llama_init_from_model(model_.handle()->ptr, params);
    }
    if (!ctx_) {
        throw Error(with_llama_reason("llama.cpp could not create a context (n_ctx=" + std::to_string(n_ctx) +
                                      ", n_seq_max=" + std::to_string(n_seq_max) +
                                      "); try a smaller n_ctx or fewer sequences"));
    }
    n_vocab_ = model_.n_vocab();
    n_seq_max_ = llama_n_seq_max(ctx_);
    n_batch_ = llama_n_batch(ctx_);
    n_threads_ = n_threads;
}

Context::~Context() {
    if (ctx_) llama_free(ctx_);
}

void Context::close() {
    if (!ctx_) return;
    Guard guard(*this);
    llama_free(ctx_);
    ctx_ = nullptr;
    output_batch_index_.clear();
}

void Context::check_seq(int64_t seq, bool allow_all) const {
    if (allow_all && seq == -1) return;
    if (seq < 0 || seq >= static_cast<int64_t>(n_seq_max_)) {
        throw InvalidArgumentError("sequence id " + std::to_string(seq) + " is outside [0, n_seq_max=" +
                                   std::to_string(n_seq_max_) + ")");
    }
}

uint32_t Context::info(uint32_t (*getter)(const llama_context *)) {
    Guard guard(*this);
    return getter(guard.get());
}

int Context::decode(const py::object & tokens_obj, const py::object & positions_obj, const py::object & seq_ids_obj,
                    const py::object & want_logits_obj) {
    Guard guard(*this);
    const std::vector<int64_t> tokens = to_int_vector(tokens_obj, "tokens");
    const std::vector<int64_t> positions = to_int_vector(positions_obj, "positions");
    const std::vector<int64_t> seq_ids = to_int_vector(seq_ids_obj, "seq_ids");
    const std::vector<bool> want = to_bool_vector(want_logits_obj, "want_logits");
    const size_t n = tokens.size();
    if (positions.size() != n || seq_ids.size() != n || want.size() != n) {
        throw InvalidArgumentError("tokens, positions, seq_ids and want_logits must have the same length (got " +
                                   std::to_string(n) + ", " + std::to_string(positions.size()) + ", " +
                                   std::to_string(seq_ids.size()) + ", " + std::to_string(want.size()) + ")");
    }
    if (n == 0) throw InvalidArgumentError("decode needs at least one token");
    if (n > n_batch_) {
        throw InvalidArgumentError("batch of " + std::to_string(n) + " tokens exceeds n_batch=" +
                                   std::to_string(n_batch_) + "; split it");
    }
    // llama.cpp requires each sequence's positions to continue its memory: Y = X + 1.
    llama_memory_t mem = llama_get_memory(ctx_);
    std::unordered_map<int64_t, int64_t> next_pos;
    for (size_t i = 0; i < n; ++i) {
        model_.check_token(tokens[i]);
        check_seq(seq_ids[i]);
        auto it = next_pos.find(seq_ids[i]);
        if (it == next_pos.end()) {
            it = next_pos.emplace(seq_ids[i], int64_t(llama_memory_seq_pos_max(mem, seq_ids[i])) + 1).first;
        }
        if (positions[i] != it->second) {
            throw InvalidArgumentError("token " + std::to_string(i) + " of sequence " + std::to_string(seq_ids[i]) +
                                       " has position " + std::to_string(positions[i]) + " but the next position of "
                                       "that sequence is " + std::to_string(it->second) +
                                       " (positions must continue the sequence, one by one)");
        }
        it->second += 1;
    }

    Batch batch(static_cast<int32_t>(n));
    std::vector<int32_t> outputs;
    for (size_t i = 0; i < n; ++i) {
        batch.batch.token[i] = static_cast<llama_token>(tokens[i]);
        batch.batch.pos[i] = static_cast<llama_pos>(positions[i]);
        batch.batch.n_seq_id[i] = 1;
        batch.batch.seq_id[i][0] = static_cast<llama_seq_id>(seq_ids[i]);
        batch.batch.logits[i] = want[i];
        if (want[i]) outputs.push_back(static_cast<int32_t>(i));
    }
    batch.batch.n_tokens = static_cast<int32_t>(n);

    output_batch_index_.clear();
    clear_last_log_error();
    int32_t ret;
    {
        py::gil_scoped_release release;
        ret = llama_decode(ctx_, batch.batch);
    }
    if (ret == 1) {
        throw NoSpaceError(with_llama_reason("no room in the context for a batch of " + std::to_string(n) +
                                             " tokens (n_ctx=" + std::to_string(llama_n_ctx(ctx_)) +
                                             "); free sequences with memory_seq_rm or use a larger n_ctx"),
                           ret);
    }
    if (ret == -1) throw InvalidArgumentError(with_llama_reason("llama.cpp rejected the batch"));
    if (ret == 2) throw DecodeError("decode was aborted", ret);
    if (ret != 0) throw DecodeError(with_llama_reason("llama_decode failed with code " + std::to_string(ret)), ret);
    output_batch_index_ = std::move(outputs);
    return static_cast<int>(output_batch_index_.size());
}

int32_t Context::output_batch_index(int64_t i) const {
    const int64_t n = static_cast<int64_t>(output_batch_index_.size());
    const int64_t k = i < 0 ? n + i : i;
    if (k < 0 || k >= n) {
        throw InvalidArgumentError("output index " + std::to_string(i) + " is out of range: the last decode has " +
                                   std::to_string(n) + " outputs");
    }
    return output_batch_index_[k];
}

py::array_t<float> Context::logits(int64_t i) {
    Guard guard(*this);
    const int32_t idx = output_batch_index(i);
    const float * src = llama_get_logits_ith(ctx_, idx);
    if (!src) throw Error(with_llama_reason("llama.cpp has no logits for output " + std::to_string(i)));
    py::array_t<float> out(n_vocab_);
    std::memcpy(out.mutable_data(), src, sizeof(float) * n_vocab_);
    return out;
}

py::array_t<float> Context::logits_all() {
    Guard guard(*this);
    const size_t n = output_batch_index_.size();
    py::array_t<float> out({n, static_cast<size_t>(n_vocab_)});
    float * dst = out.mutable_data();
    bool missing = false;
    size_t k = 0;
    {
        py::gil_scoped_release release;  // n_outputs x n_vocab floats (Gemma: 262k per output)
        for (; k < n; ++k) {
            const float * src = llama_get_logits_ith(ctx_, output_batch_index_[k]);
            if (!src) {
                missing = true;
                break;
            }
            std::memcpy(dst + k * n_vocab_, src, sizeof(float) * n_vocab_);
        }
    }
    if (missing) throw Error("llama.cpp has no logits for output " + std::to_string(k));
    return out;
}

// The first index of the largest of n logits. std::max_element compares one element at a time
// (~1 ns each: 0.27 ms per output over Gemma 3's 262k-token vocabulary, 2.4 ms for a verify of
// nine); sixteen running maxima vectorize, then a scan by blocks of sixteen finds the first
// index that holds the maximum.
static int32_t first_argmax(const float * src, int32_t n) {
    constexpr int32_t W = 16;
    float lanes[W];
    std::fill(lanes, lanes + W, -std::numeric_limits<float>::infinity());
    int32_t i = 0;
    for (; i + W <= n; i += W) {
        for (int32_t j = 0; j < W; ++j) lanes[j] = lanes[j] < src[i + j] ? src[i + j] : lanes[j];
    }
    float best = lanes[0];
    for (int32_t j = 1; j < W; ++j) best = best < lanes[j] ? lanes[j] : best;
    for (; i < n; ++i) best = best < src[i] ? src[i] : best;
    int32_t b = 0;
    for (; b + W <= n; b += W) {
        bool hit = false;
        for (int32_t j = 0; j < W; ++j) hit |= src[b + j] == best;
        if (hit) break;
    }
    for (int32_t k = b; k < n; ++k) {
        if (src[k] == best) return k;
    }
    return static_cast<int32_t>(std::max_element(src, src + n) - src);  // only NaNs get here
}

py::array_t<int32_t> Context::argmax_all() {
    Guard guard(*this);
    const size_t n = output_batch_index_.size();
    py::array_t<int32_t> out(n);
    int32_t * dst = out.mutable_data();
    bool missing = false;
    size_t k = 0;
    {
        py::gil_scoped_release release;
        for (; k < n; ++k) {
            const float * src = llama_get_logits_ith(ctx_, output_batch_index_[k]);
            if (!src) {
                missing = true;
                break;
            }
            dst[k] = first_argmax(src, n_vocab_);
        }
    }
    if (missing) throw Error("llama.cpp has no logits for output " + std::to_string(k));
    return out;
}

size_t Context::state_seq_size(int64_t seq, bool partial) {
    Guard guard(*this);
    check_seq(seq);
    return llama_state_seq_get_size_ext(ctx_, static_cast<llama_seq_id>(seq),
                                        partial ? LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY : LLAMA_STATE_SEQ_FLAGS_NONE);
}

py::bytes Context::state_seq_get(int64_t seq, bool partial) {
    Guard guard(*this);
    check_seq(seq);
    const llama_state_seq_flags flags = partial ? LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY : LLAMA_STATE_SEQ_FLAGS_NONE;
    const size_t size = llama_state_seq_get_size_ext(ctx_, static_cast<llama_seq_id>(seq), flags);
    // Write straight into a new bytes object: one copy, made with the GIL released.
    PyObject * raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
    if (!raw) throw py::error_already_set();
    py::bytes out = py::reinterpret_steal<py::bytes>(raw);
    auto * dst = reinterpret_cast<uint8_t *>(PyBytes_AS_STRING(raw));
    size_t written;
    {
        py::gil_scoped_release release;
        written = llama_state_seq_get_data_ext(ctx_, dst, size, static_cast<llama_seq_id>(seq), flags);
    }
    if (written != size) {
        throw StateError(with_llama_reason("reading the state of sequence " + std::to_string(seq) + " gave " +
                                           std::to_string(written) + " bytes, expected " + std::to_string(size)));
    }
    return out;
}

void Context::state_seq_set(int64_t seq, const py::buffer & data, bool partial) {
    Guard guard(*this);
    check_seq(seq);
    const py::buffer_info info = data.request();
    if (info.ndim != 1 || info.itemsize != 1) throw InvalidArgumentError("state data must be bytes");
    if (info.size > 1 && info.strides[0] != 1) {
        // A strided or reversed view: llama.cpp reads size bytes forward from ptr.
        throw InvalidArgumentError("state data must be contiguous bytes (got a view with stride " +
                                   std::to_string(info.strides[0]) + "); pass bytes(view)");
    }
    const size_t size = static_cast<size_t>(info.size);
    if (size == 0) throw StateError("empty state data: pass what state_seq_get returned");
    const llama_state_seq_flags flags = partial ? LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY : LLAMA_STATE_SEQ_FLAGS_NONE;
    clear_last_log_error();
    size_t read;
    {
        py::gil_scoped_release release;
        read = llama_state_seq_set_data_ext(ctx_, static_cast<const uint8_t *>(info.ptr), size,
                                            static_cast<llama_seq_id>(seq), flags);
    }
    if (read == 0) {
        throw StateError(with_llama_reason("restoring the state of sequence " + std::to_string(seq) +
                                           " failed: the data does not match this context and flags (the sequence "
                                           "is now cleared)"));
    }
    if (read != size) {
        throw StateError("state size mismatch for sequence " + std::to_string(seq) + ": llama.cpp used " +
                         std::to_string(read) + " of " + std::to_string(size) + " bytes");
    }
}

bool Context::memory_seq_rm(int64_t seq, int64_t p0, int64_t p1) {
    Guard guard(*this);
    check_seq(seq, true);
    const llama_pos from = to_pos(p0, "p0"), to = to_pos(p1, "p1");
    return llama_memory_seq_rm(llama_get_memory(ctx_), static_cast<llama_seq_id>(seq), from, to);
}

void Context::memory_seq_cp(int64_t src, int64_t dst, int64_t p0, int64_t p1) {
    Guard guard(*this);
    check_seq(src);
    check_seq(dst);
    const llama_pos from = to_pos(p0, "p0"), to = to_pos(p1, "p1");
    llama_memory_seq_cp(llama_get_memory(ctx_), static_cast<llama_seq_id>(src), static_cast<llama_seq_id>(dst), from,
                        to);
}

void Context::memory_seq_keep(int64_t seq) {
    Guard guard(*this);
    check_seq(seq);
    llama_memory_seq_keep(llama_get_memory(ctx_), static_cast<llama_seq_id>(seq));
}

int32_t Context::memory_seq_pos_min(int64_t seq) {
    Guard guard(*this);
    check_seq(seq);
    return llama_memory_seq_pos_min(llama_get_memory(ctx_), static_cast<llama_seq_id>(seq));
}

int32_t Context::memory_seq_pos_max(int64_t seq) {
    Guard guard(*this);
    check_seq(seq);
    return llama_memory_seq_pos_max(llama_get_memory(ctx_), static_cast<llama_seq_id>(seq));
}

void Context::memory_clear(bool data) {
    Guard guard(*this);
    llama_memory_clear(llama_get_memory(ctx_), data);
    output_batch_index_.clear();
}

void bind_context(py::module_ & m) {
    py::class_<Context>(m, "Context", R"doc(
A llama.cpp context: the memory (KV cache and recurrent state) of up to n_seq_max sequences.

Owns its llama_context and keeps its Model's weights alive. One thread at a time: a call that
enters while another thread is inside raises ConcurrentUseError. decode, logits_all, argmax_all
and the state copies release the GIL. Every method raises ClosedError after close().
)doc")
        .def(py::init<const Model &, uint32_t, uint32_t, uint32_t, uint32_t, int32_t, uint32_t, bool>(),
             py::arg("model"), py::kw_only(), py::arg("n_ctx") = 4096, py::arg("n_batch") = 512,
             py::arg("n_ubatch") = 512, py::arg("n_seq_max") = 1, py::arg("n_threads") = 0, py::arg("n_rs_seq") = 0,
             py::arg("kv_unified") = false,
             "n_ctx is shared by the sequences (each gets n_ctx / n_seq_max unless kv_unified); n_threads 0 = all "
             "cores; n_rs_seq > 0 keeps that many recurrent-state snapshots per sequence (llama.cpp EXPERIMENTAL).")
        .def_property_readonly("model", [](const Context & s) { return Model(s.model()); },
                               "A new Model object sharing this context's weights: closing it leaves the context "
                               "(and its weights) alone.")
        .def_property_readonly("n_vocab", &Context::n_vocab)
        .def_property_readonly("n_ctx", [](Context & s) { return s.info(llama_n_ctx); })
        .def_property_readonly("n_ctx_seq", [](Context & s) { return s.info(llama_n_ctx_seq); },
                               "Context available to one sequence.")
        .def_property_readonly("n_batch", [](Context & s) { return s.info(llama_n_batch); })
        .def_property_readonly("n_ubatch", [](Context & s) { return s.info(llama_n_ubatch); })
        .def_property_readonly("n_seq_max", [](Context & s) { return s.info(llama_n_seq_max); })
        .def_property_readonly("n_rs_seq", [](Context & s) { return s.info(llama_n_rs_seq); })
        .def_property_readonly("n_threads", [](const Context & s) { return s.n_threads_; })
        .def_property_readonly("n_outputs", &Context::n_outputs, "Outputs (tokens with logits) of the last decode.")
        .def_property_readonly("closed", &Context::closed)
        .def("decode", &Context::decode, py::arg("tokens"), py::arg("positions"), py::arg("seq_ids"),
             py::arg("want_logits"), R"doc(
Decode one batch that may mix tokens of several sequences. Returns the number of outputs.

All four are 1-D sequences or numpy arrays of the same length (<= n_batch). Each sequence's
positions must continue its memory one by one (the first is memory_seq_pos_max(seq) + 1).
Raises InvalidArgumentError for bad input, NoSpaceError when the context is full,
DecodeError for other failures. The GIL is released while llama.cpp runs.
)doc")
        .def("logits", &Context::logits, py::arg("i"), R"doc(
Logits of the i-th output of the last decode (i counts only tokens decoded with want_logits,
in batch order; negative counts from the end), as a new float32 array of n_vocab. It is a
copy: later decodes do not change it.
)doc")
        .def("logits_all", &Context::logits_all, "All outputs of the last decode as a new (n_outputs, n_vocab) array.")
        .def("argmax_all", &Context::argmax_all, "The argmax token of every output of the last decode (int32 array).")
        .def("state_seq_size", &Context::state_seq_size, py::arg("seq"), py::arg("partial") = true,
             "Bytes needed for the state of one sequence. partial = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: only the "
             "recurrent / SWA part, not the full attention cache.")
        .def("state_seq_get", &Context::state_seq_get, py::arg("seq"), py::arg("partial") = true,
             "A copy of one sequence's state as bytes (GIL released while copying).")
        .def("state_seq_set", &Context::state_seq_set, py::arg("seq"), py::arg("data"), py::arg("partial") = true,
             "Restore a state from state_seq_get into a sequence. With partial=True the attention cache is not "
             "touched: trim it with memory_seq_rm. Raises StateError when it does not fit.")
        .def("memory_seq_rm", &Context::memory_seq_rm, py::arg("seq"), py::arg("p0") = -1, py::arg("p1") = -1,
             "Remove positions [p0, p1) of a sequence (-1: open end; seq -1: every sequence). False when the memory "
             "cannot remove a partial range (recurrent state); removing a whole sequence always succeeds. "
             "Positions outside [-1, 2^31) are an InvalidArgumentError.")
        .def("memory_seq_cp", &Context::memory_seq_cp, py::arg("src"), py::arg("dst"), py::arg("p0") = -1,
             py::arg("p1") = -1)
        .def("memory_seq_keep", &Context::memory_seq_keep, py::arg("seq"))
        .def("memory_seq_pos_min", &Context::memory_seq_pos_min, py::arg("seq"), "-1 when the sequence is empty.")
        .def("memory_seq_pos_max", &Context::memory_seq_pos_max, py::arg("seq"), "-1 when the sequence is empty.")
        .def("memory_clear", &Context::memory_clear, py::arg("data") = true, "Empty every sequence.")
        .def("close", &Context::close, "Free the llama_context now (also done when the object is collected).")
        .def("__enter__", [](Context & s) -> Context & { return s; }, py::return_value_policy::reference)
        .def("__exit__", [](Context & s, py::args) { s.close(); });
}

}  // namespace hyspec
