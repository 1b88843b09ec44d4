// hyspec._native.Model: a loaded GGUF (llama_model) and its vocabulary.
#pragma once

#include "llama.h"

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

namespace hyspec {

// Owns one llama_model. Shared by the Model object and by every Context created from it,
// so a context keeps its model alive after Model.close().
struct ModelHandle {
    llama_model * ptr;
    explicit ModelHandle(llama_model * p) : ptr(p) {}
    ~ModelHandle() { llama_model_free(ptr); }
    ModelHandle(const ModelHandle &) = delete;
    ModelHandle & operator=(const ModelHandle &) = delete;
};

class Model {
public:
    Model(const std::string & path, int n_gpu_layers, bool use_mmap, bool vocab_only, pybind11::object progress);

    // The handle; throws ClosedError after close().
    const std::shared_ptr<ModelHandle> & handle() const;
    const llama_vocab * vocab() const;
    void close() { handle_.reset(); }
    bool closed() const { return !handle_; }
    const std::string & path() const { return path_; }
    int n_gpu_layers() const { return n_gpu_layers_; }

    int32_t n_vocab() const;
    // Throws InvalidArgumentError unless 0 <= token < n_vocab.
    void check_token(int64_t token) const;

    std::string arch() const;
    pybind11::dict metadata() const;
    // Both release the GIL while llama.cpp works (the weights stay alive through a handle copy).
    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    // Text with invalid UTF-8 (a token holding part of a character) decoded with replacement characters.
    pybind11::str detokenize(const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) const;
    pybind11::bytes token_to_piece(llama_token token, bool special) const;
    pybind11::object chat_template(const pybind11::object & name) const;
    std::string apply_chat_template(const pybind11::list & messages, bool add_assistant, const pybind11::object & tmpl) const;

private:
    std::shared_ptr<ModelHandle> handle_;
    std::string path_;
    int n_gpu_layers_ = 0;  // as passed to llama_model_params (negative: all layers)
};

void bind_model(pybind11::module_ & m);
// Stops every model load in progress at its next progress step (Model raises ModelLoadError).
void cancel_loads();

}  // namespace hyspec
