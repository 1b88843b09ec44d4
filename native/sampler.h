#pragma once

#include "context.h"
#include "model.h"

#include <pybind11/pybind11.h>

#include <atomic>
#include <vector>

namespace hyspec {

class Sampler {
public:
    Sampler(const Model & model, float temperature, int32_t top_k, float top_p, float min_p, float repeat_penalty,
            float frequency_penalty, float presence_penalty, int32_t penalty_last_n, uint32_t seed);
    Sampler(const Sampler & other);  // llama_sampler_clone: same history, same RNG state
    Sampler & operator=(const Sampler &) = delete;
    ~Sampler();

    llama_token sample(Context & ctx, int64_t i);
    void accept(int64_t token);
    pybind11::tuple distribution(Context & ctx, int64_t i);
    pybind11::tuple candidates(Context & ctx, int64_t i);
    llama_sampler * chain() const { return chain_; }
    bool greedy() const { return greedy_; }

    // Marks the sampler busy for one call: sample() and the staged helpers run without the GIL,
    // so a second thread using the same sampler meanwhile gets ConcurrentUseError.
    class Busy {
    public:
        explicit Busy(const Sampler & s);
        ~Busy();
        Busy(const Busy &) = delete;
        Busy & operator=(const Busy &) = delete;

    private:
        const Sampler & s_;
    };

private:
    // Output i's candidates after every stage of the chain but the final selector (greedy or
    // dist), in the order that selector walks them.
    std::vector<llama_token_data> staged(Context & ctx, int64_t i);

    llama_sampler * chain_ = nullptr;
    int32_t n_vocab_;
    bool greedy_;
    mutable std::atomic<bool> busy_{false};
};

void bind_sampler(pybind11::module_ & m);

}  // namespace hyspec
