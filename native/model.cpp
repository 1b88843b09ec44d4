#include "model.h"

#include "errors.h"

#include <pybind11/stl.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace py = pybind11;

namespace hyspec {
namespace {

// Reads a metadata value; llama returns the full length, so a second call fits long values.
std::string meta_string(const llama_model * model, int32_t index, bool key) {
    std::vector<char> buf(256);
    for (int attempt = 0; attempt < 2; ++attempt) {
        const int32_t n = key ? llama_model_meta_key_by_index(model, index, buf.data(), buf.size())
                              : llama_model_meta_val_str_by_index(model, index, buf.data(), buf.size());
        if (n < 0) return {};
        if (static_cast<size_t>(n) < buf.size()) return std::string(buf.data(), n);
        buf.resize(n + 1);
    }
    return {};
}

void check_gguf_file(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        throw ModelLoadError("cannot open model file '" + path + "': check that the path exists and is readable");
    }
    char magic[4] = {0, 0, 0, 0};
    f.read(magic, 4);
    if (f.gcount() != 4 || std::memcmp(magic, "GGUF", 4) != 0) {
        throw ModelLoadError("'" + path + "' is not a GGUF file (bad magic); pass a .gguf model");
    }
}

// Bumped by cancel_loads(): a load whose epoch is older stops at its next progress step.
std::atomic<uint64_t> g_load_epoch{0};

struct LoadProgress {
    uint64_t epoch;
    py::object * callback;  // nullptr: none
};

bool on_progress(float fraction, void * user_data) {
    auto * state = static_cast<LoadProgress *>(user_data);
    if (g_load_epoch.load() != state->epoch) return false;  // llama.cpp then abandons the load
    if (state->callback) {
        py::gil_scoped_acquire gil;
        try {
            (*state->callback)(fraction);
        } catch (py::error_already_set & e) {
            e.discard_as_unraisable("hyspec._native.Model progress callback");
        }
    }
    return true;
}

}  // namespace

Model::Model(const std::string & path, int n_gpu_layers, bool use_mmap, bool vocab_only, py::object progress)
    : path_(path), n_gpu_layers_(n_gpu_layers) {
    check_gguf_file(path);
    llama_model_params params = llama_model_default_params();
    params.n_gpu_layers = n_gpu_layers;
    if (!use_mmap) params.load_mode = LLAMA_LOAD_MODE_NONE;
    params.vocab_only = vocab_only;
    LoadProgress state{g_load_epoch.load(), progress.is_none() ? nullptr : &progress};
    params.progress_callback = on_progress;
    params.progress_callback_user_data = &state;
    clear_last_log_error();
    llama_model * model = nullptr;
    {
        py::gil_scoped_release release;
        model = llama_model_load_from_file(path.c_str(), params);
    }
    if (!model && g_load_epoch.load() != state.epoch) {
        throw ModelLoadError("loading '" + path + "' was cancelled (the server is shutting down)");
    }
    if (!model) {
        throw ModelLoadError(with_llama_reason("llama.cpp could not load '" + path + "': the file is corrupt, truncated "
                                               "or of an unsupported architecture"));
    }
    handle_ = std::make_shared<ModelHandle>(model);
}

const std::shared_ptr<ModelHandle> & Model::handle() const {
    if (!handle_) throw ClosedError("Model is closed");
    return handle_;
}

const llama_vocab * Model::vocab() const { return llama_model_get_vocab(handle()->ptr); }

int32_t Model::n_vocab() const { return llama_vocab_n_tokens(vocab()); }

void Model::check_token(int64_t token) const {
    const int32_t n = n_vocab();
    if (token < 0 || token >= n) {
        throw InvalidArgumentError("token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                                   std::to_string(n) + ")");
    }
}

std::string Model::arch() const {
    py::dict meta = metadata();
    return meta.contains("general.architecture") ? meta["general.architecture"].cast<std::string>() : std::string();
}

py::dict Model::metadata() const {
    const llama_model * model = handle()->ptr;
    py::dict out;
    const int32_t n = llama_model_meta_count(model);
    for (int32_t i = 0; i < n; ++i) {
        const std::string key = meta_string(model, i, true);
        const std::string val = meta_string(model, i, false);
        out[py::str(key)] = py::reinterpret_steal<py::object>(
            PyUnicode_DecodeUTF8(val.data(), static_cast<Py_ssize_t>(val.size()), "replace"));
    }
    return out;
}

std::vector<llama_token> Model::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    if (text.size() > static_cast<size_t>(INT32_MAX / 2)) throw InvalidArgumentError("text is too long to tokenize");
    const std::shared_ptr<ModelHandle> keep = handle();  // Model.close() on another thread meanwhile is safe
    const llama_vocab * v = llama_model_get_vocab(keep->ptr);
    std::vector<llama_token> tokens(text.size() + 2);
    int32_t n;
    {
        py::gil_scoped_release release;
        n = llama_tokenize(v, text.data(), static_cast<int32_t>(text.size()), tokens.data(),
                           static_cast<int32_t>(tokens.size()), add_special, parse_special);
        if (n < 0 && n != INT32_MIN) {
            tokens.resize(-n);
            n = llama_tokenize(v, text.data(), static_cast<int32_t>(text.size()), tokens.data(),
                               static_cast<int32_t>(tokens.size()), add_special, parse_special);
        }
    }
    if (n == INT32_MIN) throw InvalidArgumentError("text is too long to tokenize");
    if (n < 0) throw Error(with_llama_reason("tokenization failed"));
    tokens.resize(n);
    return tokens;
}

py::str Model::detokenize(const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) const {
    for (llama_token t : tokens) check_token(t);
    if (tokens.size() > static_cast<size_t>(INT32_MAX / 16)) throw InvalidArgumentError("too many tokens to detokenize");
    const std::shared_ptr<ModelHandle> keep = handle();
    const llama_vocab * v = llama_model_get_vocab(keep->ptr);
    std::string text(tokens.size() * 8 + 16, '\0');
    int32_t n;
    {
        py::gil_scoped_release release;
        n = llama_detokenize(v, tokens.data(), static_cast<int32_t>(tokens.size()), text.data(),
                             static_cast<int32_t>(text.size()), remove_special, unparse_special);
        if (n < 0 && n != INT32_MIN) {
            text.resize(-n);
            n = llama_detokenize(v, tokens.data(), static_cast<int32_t>(tokens.size()), text.data(),
                                 static_cast<int32_t>(text.size()), remove_special, unparse_special);
        }
    }
    if (n < 0) throw Error("detokenization failed");
    PyObject * out = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(n), "replace");
    if (!out) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(out);
}

void cancel_loads() { g_load_epoch.fetch_add(1); }

py::bytes Model::token_to_piece(llama_token token, bool special) const {
    check_token(token);
    std::string piece(32, '\0');
    int32_t n = llama_token_to_piece(vocab(), token, piece.data(), static_cast<int32_t>(piece.size()), 0, special);
    if (n < 0) {
        piece.resize(-n);
        n = llama_token_to_piece(vocab(), token, piece.data(), static_cast<int32_t>(piece.size()), 0, special);
    }
    if (n < 0) throw Error("token_to_piece failed for token " + std::to_string(token));
    piece.resize(n);
    return py::bytes(piece);
}

py::object Model::chat_template(const py::object & name) const {
    std::string name_str;
    const char * name_ptr = nullptr;
    if (!name.is_none()) {
        name_str = name.cast<std::string>();
        name_ptr = name_str.c_str();
    }
    const char * tmpl = llama_model_chat_template(handle()->ptr, name_ptr);
    if (!tmpl) return py::none();
    return py::str(tmpl);
}

std::string Model::apply_chat_template(const py::list & messages, bool add_assistant, const py::object & tmpl) const {
    std::string tmpl_str;
    if (tmpl.is_none()) {
        py::object own = chat_template(py::none());
        if (own.is_none()) {
            throw TemplateError("the model has no chat template (tokenizer.chat_template); send a plain text prompt");
        }
        tmpl_str = own.cast<std::string>();
    } else {
        tmpl_str = tmpl.cast<std::string>();
    }
    if (messages.empty()) throw InvalidArgumentError("a chat needs at least one message");
    std::vector<std::string> roles, contents;
    for (const py::handle & item : messages) {
        py::object role, content;
        if (py::isinstance<py::dict>(item)) {
            py::dict d = py::reinterpret_borrow<py::dict>(item);
            if (!d.contains("role") || !d.contains("content")) {
                throw InvalidArgumentError("each chat message needs 'role' and 'content'");
            }
            role = d["role"];
            content = d["content"];
        } else {
            py::sequence seq = py::reinterpret_borrow<py::sequence>(item);
            if (seq.size() != 2) throw InvalidArgumentError("a chat message is a {'role', 'content'} dict or a pair");
            role = seq[0];
            content = seq[1];
        }
        if (!py::isinstance<py::str>(role) || !py::isinstance<py::str>(content)) {
            throw InvalidArgumentError("chat message role and content must be strings");
        }
        roles.push_back(role.cast<std::string>());
        contents.push_back(content.cast<std::string>());
    }
    std::vector<llama_chat_message> chat;
    size_t total = 0;
    for (size_t i = 0; i < roles.size(); ++i) {
        chat.push_back({roles[i].c_str(), contents[i].c_str()});
        total += roles[i].size() + contents[i].size();
    }
    std::string out(2 * total + 256, '\0');
    int32_t n = llama_chat_apply_template(tmpl_str.c_str(), chat.data(), chat.size(), add_assistant, out.data(),
                                          static_cast<int32_t>(out.size()));
    if (n > static_cast<int32_t>(out.size())) {
        out.resize(n);
        n = llama_chat_apply_template(tmpl_str.c_str(), chat.data(), chat.size(), add_assistant, out.data(),
                                      static_cast<int32_t>(out.size()));
    }
    if (n < 0) {
        throw TemplateError("llama.cpp does not support this model's chat template (only its built-in templates "
                            "are understood); send a plain text prompt");
    }
    out.resize(n);
    return out;
}

void bind_model(py::module_ & m) {
    py::class_<Model>(m, "Model", R"doc(
A GGUF model loaded with llama.cpp (weights, or only the vocabulary).

Owns its llama_model. Every Context made from it holds a reference, so the weights stay
loaded until the last Context is closed even after Model.close(). Methods raise ClosedError
after close(). Loading releases the GIL.
)doc")
        .def(py::init<const std::string &, int, bool, bool, py::object>(), py::arg("path"), py::kw_only(),
             py::arg("n_gpu_layers") = 0, py::arg("use_mmap") = true, py::arg("vocab_only") = false,
             py::arg("progress") = py::none(),
             "Load a GGUF. `progress(fraction)` is called during loading. Raises ModelLoadError.")
        .def_property_readonly("path", &Model::path)
        .def_property_readonly("n_gpu_layers", &Model::n_gpu_layers,
                               "Layers llama.cpp was asked to offload to a GPU (negative: all); a CPU-only build "
                               "offloads none whatever this says (see supports_gpu_offload()).")
        .def_property_readonly("n_vocab", &Model::n_vocab, "Number of tokens in the vocabulary.")
        .def_property_readonly("n_ctx_train", [](const Model & s) { return llama_model_n_ctx_train(s.handle()->ptr); })
        .def_property_readonly("n_embd", [](const Model & s) { return llama_model_n_embd(s.handle()->ptr); })
        .def_property_readonly("n_layer", [](const Model & s) { return llama_model_n_layer(s.handle()->ptr); })
        .def_property_readonly("n_params", [](const Model & s) { return llama_model_n_params(s.handle()->ptr); })
        .def_property_readonly("size", [](const Model & s) { return llama_model_size(s.handle()->ptr); },
                               "Size of the weights in bytes.")
        .def_property_readonly("description", [](const Model & s) {
            char buf[256];
            const int32_t n = llama_model_desc(s.handle()->ptr, buf, sizeof(buf));
            return std::string(buf, n > 0 ? std::min<size_t>(n, sizeof(buf) - 1) : 0);
        })
        .def_property_readonly("arch", &Model::arch, "general.architecture, e.g. 'lfm2', 'llama', 'gemma3'.")
        .def_property_readonly("is_hybrid", [](const Model & s) { return llama_model_is_hybrid(s.handle()->ptr); },
                               "True when layers mix attention with recurrent state (LFM2, Jamba, ...).")
        .def_property_readonly("is_recurrent",
                               [](const Model & s) { return llama_model_is_recurrent(s.handle()->ptr); },
                               "True for purely recurrent models (Mamba, RWKV).")
        .def_property_readonly("bos", [](const Model & s) -> py::object {
            const llama_token t = llama_vocab_bos(s.vocab());
            if (t == LLAMA_TOKEN_NULL) return py::none();
            return py::int_(t);
        })
        .def_property_readonly("eos", [](const Model & s) -> py::object {
            const llama_token t = llama_vocab_eos(s.vocab());
            if (t == LLAMA_TOKEN_NULL) return py::none();
            return py::int_(t);
        })
        .def_property_readonly("metadata", &Model::metadata, "All GGUF key/value pairs, values as strings.")
        .def_property_readonly("closed", &Model::closed)
        .def("tokenize", &Model::tokenize, py::arg("text"), py::arg("add_special") = true,
             py::arg("parse_special") = false,
             "Text to token ids. add_special adds BOS/EOS as the model is configured; parse_special lets control "
             "token text (e.g. '<start_of_turn>') become control tokens. Releases the GIL.")
        .def("detokenize", &Model::detokenize, py::arg("tokens"), py::arg("remove_special") = false,
             py::arg("unparse_special") = false,
             "Token ids to text; bytes that are not valid UTF-8 on their own (part of a character) become "
             "U+FFFD replacement characters. Raises InvalidArgumentError for ids outside the vocabulary. "
             "Releases the GIL.")
        .def("token_to_piece", &Model::token_to_piece, py::arg("token"), py::arg("special") = false,
             "The bytes of one token; may be a partial UTF-8 sequence. special renders control tokens.")
        .def("is_eog", [](const Model & s, int64_t t) {
            s.check_token(t);
            return llama_vocab_is_eog(s.vocab(), static_cast<llama_token>(t));
        }, py::arg("token"), "True for end-of-generation tokens (EOS, EOT, ...).")
        .def("chat_template", &Model::chat_template, py::arg("name") = py::none(),
             "The model's chat template string, or None.")
        .def("apply_chat_template", &Model::apply_chat_template, py::arg("messages"), py::arg("add_assistant") = true,
             py::arg("template") = py::none(),
             "Format [{'role', 'content'}, ...] with the model's template (llama.cpp's built-in templates). "
             "Raises TemplateError when the model has none or it is not supported.")
        .def("close", &Model::close, "Drop this object's reference to the weights.")
        .def("__enter__", [](Model & s) -> Model & { return s; }, py::return_value_policy::reference)
        .def("__exit__", [](Model & s, py::args) { s.close(); })
        .def("__repr__", [](const Model & s) {
            return s.closed() ? std::string("<Model closed>") : "<Model " + s.arch() + " '" + s.path() + "'>";
        });
}

}  // namespace hyspec
