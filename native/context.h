// hyspec._native.Context: one llama_context, several sequences (slots) in it.
#pragma once

#include "model.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <memory>
#include <vector>

namespace hyspec {

class Context {
public:
    Context(const Model & model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch, uint32_t n_seq_max,
            int32_t n_threads, uint32_t n_rs_seq, bool kv_unified);
    ~Context();

    // Marks the context busy for one call; a second thread entering meanwhile gets
    // ConcurrentUseError instead of corrupting llama.cpp's state.
    class Guard {
    public:
        explicit Guard(Context & ctx);
        ~Guard();
        Guard(const Guard &) = delete;
        Guard & operator=(const Guard &) = delete;
        llama_context * get() const { return ctx_.ctx_; }

    private:
        Context & ctx_;
    };

    void close();
    bool closed() const { return ctx_ == nullptr; }
    const Model & model() const { return model_; }
    int32_t n_vocab() const { return n_vocab_; }
    uint32_t n_seq_max() const { return n_seq_max_; }

    int decode(const pybind11::object & tokens, const pybind11::object & positions, const pybind11::object & seq_ids,
               const pybind11::object & want_logits);
    // Batch index of the i-th output of the last decode (negative i counts from the end).
    int32_t output_batch_index(int64_t i) const;
    int n_outputs() const { return static_cast<int>(output_batch_index_.size()); }
    pybind11::array_t<float> logits(int64_t i);
    pybind11::array_t<float> logits_all();
    pybind11::array_t<int32_t> argmax_all();

    size_t state_seq_size(int64_t seq, bool partial);
    pybind11::bytes state_seq_get(int64_t seq, bool partial);
    void state_seq_set(int64_t seq, const pybind11::buffer & data, bool partial);

    bool memory_seq_rm(int64_t seq, int64_t p0, int64_t p1);
    void memory_seq_cp(int64_t src, int64_t dst, int64_t p0, int64_t p1);
    void memory_seq_keep(int64_t seq);
    int32_t memory_seq_pos_min(int64_t seq);
    int32_t memory_seq_pos_max(int64_t seq);
    void memory_clear(bool data);

    void check_seq(int64_t seq, bool allow_all = false) const;

    uint32_t info(uint32_t (*getter)(const llama_context *));

private:
    Model model_;  // shares the weights' handle: a context keeps its model alive
    llama_context * ctx_ = nullptr;
    std::atomic<bool> busy_{false};
    std::vector<int32_t> output_batch_index_;
    int32_t n_vocab_ = 0;
    uint32_t n_seq_max_ = 0;
    uint32_t n_batch_ = 0;
    int32_t n_threads_ = 0;

    friend void bind_context(pybind11::module_ & m);
};

void bind_context(pybind11::module_ & m);

}  // namespace hyspec
