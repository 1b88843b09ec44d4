// hyspec._native.Sampler: llama.cpp's sampler chain, driven one position at a time.
#include "sampler.h"

#include "errors.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace py = pybind11;

namespace hyspec {

Sampler::Sampler(const Model & model, float temperature, int32_t top_k, float top_p, float min_p,
                 float repeat_penalty, float frequency_penalty, float presence_penalty, int32_t penalty_last_n,
                 uint32_t seed)
    : n_vocab_(model.n_vocab()), greedy_(temperature == 0.0f) {
    if (!(temperature >= 0.0f) || !std::isfinite(temperature)) throw InvalidArgumentError("temperature must be >= 0");
    if (top_k < 0) throw InvalidArgumentError("top_k must be >= 0 (0 = off)");
    if (!(top_p > 0.0f && top_p <= 1.0f)) throw InvalidArgumentError("top_p must be in (0, 1]");
    if (!(min_p >= 0.0f && min_p <= 1.0f)) throw InvalidArgumentError("min_p must be in [0, 1]");
    if (!(repeat_penalty > 0.0f) || !std::isfinite(repeat_penalty)) {
        throw InvalidArgumentError("repeat_penalty must be > 0 (1 = off)");
    }
    if (!std::isfinite(frequency_penalty) || !std::isfinite(presence_penalty)) {
        throw InvalidArgumentError("frequency_penalty and presence_penalty must be finite");
    }
    if (penalty_last_n < -1) throw InvalidArgumentError("penalty_last_n must be >= -1 (-1 = whole context)");

    llama_sampler_chain_params params = llama_sampler_chain_default_params();
    params.no_perf = true;
    chain_ = llama_sampler_chain_init(params);
    if (repeat_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_penalties(n_vocab_, penalty_last_n, repeat_penalty,
                                                                     frequency_penalty, presence_penalty));
    }
    if (greedy_) {
        llama_sampler_chain_add(chain_, llama_sampler_init_greedy());
        return;
    }
    if (top_k > 0) llama_sampler_chain_add(chain_, llama_sampler_init_top_k(top_k));
    if (top_p < 1.0f) llama_sampler_chain_add(chain_, llama_sampler_init_top_p(top_p, 1));
    if (min_p > 0.0f) llama_sampler_chain_add(chain_, llama_sampler_init_min_p(min_p, 1));
    llama_sampler_chain_add(chain_, llama_sampler_init_temp(temperature));
    llama_sampler_chain_add(chain_, llama_sampler_init_dist(seed));
}

Sampler::Busy::Busy(const Sampler & s) : s_(s) {
    bool expected = false;
    if (!s.busy_.compare_exchange_strong(expected, true)) {
        throw ConcurrentUseError("this Sampler is in use by another thread; a Sampler belongs to one thread");
    }
}

Sampler::Busy::~Busy() { s_.busy_.store(false); }

Sampler::Sampler(const Sampler & other)
    : chain_(nullptr), n_vocab_(other.n_vocab_), greedy_(other.greedy_) {
    Busy busy(other);
    chain_ = llama_sampler_clone(other.chain_);
}

Sampler::~Sampler() {
    if (chain_) llama_sampler_free(chain_);
}

llama_token Sampler::sample(Context & ctx, int64_t i) {
    Busy busy(*this);
    Context::Guard guard(ctx);
    if (ctx.n_vocab() != n_vocab_) throw InvalidArgumentError("the sampler was made for another vocabulary size");
    const int32_t idx = ctx.output_batch_index(i);
    py::gil_scoped_release release;  // top-p sorts the whole vocabulary
    return llama_sampler_sample(chain_, guard.get(), idx);
}

void Sampler::accept(int64_t token) {
    if (token < 0 || token >= n_vocab_) {
        throw InvalidArgumentError("token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                                   std::to_string(n_vocab_) + ")");
    }
    Busy busy(*this);
    llama_sampler_accept(chain_, static_cast<llama_token>(token));
}

std::vector<llama_token_data> Sampler::staged(Context & ctx, int64_t i) {
    Busy busy(*this);
    Context::Guard guard(ctx);
    if (ctx.n_vocab() != n_vocab_) throw InvalidArgumentError("the sampler was made for another vocabulary size");
    const float * logits = llama_get_logits_ith(guard.get(), ctx.output_batch_index(i));
    if (!logits) throw Error("llama.cpp has no logits for this output");
    std::vector<llama_token_data> cur(n_vocab_);
    for (int32_t t = 0; t < n_vocab_; ++t) cur[t] = llama_token_data{t, logits[t], 0.0f};
    llama_token_data_array arr{cur.data(), cur.size(), -1, false};
    {
        py::gil_scoped_release release;  // top-p sorts the whole vocabulary
        const int32_t n_stages = llama_sampler_chain_n(chain_);
        for (int32_t s = 0; s + 1 < n_stages; ++s) llama_sampler_apply(llama_sampler_chain_get(chain_, s), &arr);
    }
    return std::vector<llama_token_data>(arr.data, arr.data + arr.size);
}

py::tuple Sampler::distribution(Context & ctx, int64_t i) {
    std::vector<llama_token_data> kept = staged(ctx, i);
    std::sort(kept.begin(), kept.end(), [](const auto & a, const auto & b) { return a.logit > b.logit; });
    if (greedy_) kept.resize(1);
    py::array_t<int32_t> ids(kept.size());
    py::array_t<float> probs(kept.size());
    const float max_logit = kept.empty() ? 0.0f : kept[0].logit;
    double total = 0.0;
    for (size_t k = 0; k < kept.size(); ++k) total += std::exp(double(kept[k].logit) - max_logit);
    for (size_t k = 0; k < kept.size(); ++k) {
        ids.mutable_data()[k] = kept[k].id;
        probs.mutable_data()[k] = greedy_ ? 1.0f : static_cast<float>(std::exp(double(kept[k].logit) - max_logit) / total);
    }
    return py::make_tuple(ids, probs);
}

py::tuple Sampler::candidates(Context & ctx, int64_t i) {
    const std::vector<llama_token_data> kept = staged(ctx, i);
    py::array_t<int32_t> ids(kept.size());
    py::array_t<float> logits(kept.size());
    for (size_t k = 0; k < kept.size(); ++k) {
        ids.mutable_data()[k] = kept[k].id;
        logits.mutable_data()[k] = kept[k].logit;
    }
    return py::make_tuple(ids, logits);
}

void bind_sampler(py::module_ & m) {
    py::class_<Sampler>(m, "Sampler", R"doc(
llama.cpp's sampler chain for one sequence: [penalties] -> greedy, or
[penalties] -> [top_k] -> [top_p] -> [min_p] -> temperature -> dist(seed).

Stateful: the penalties remember accepted tokens and dist owns an RNG stream. sample() draws
and accepts the drawn token; accept() records a token chosen elsewhere. sample(), distribution()
and candidates() release the GIL; one thread at a time (ConcurrentUseError otherwise).
)doc")
        .def(py::init<const Model &, float, int32_t, float, float, float, float, float, int32_t, uint32_t>(),
             py::arg("model"), py::kw_only(), py::arg("temperature") = 0.0f, py::arg("top_k") = 0,
             py::arg("top_p") = 1.0f, py::arg("min_p") = 0.0f, py::arg("repeat_penalty") = 1.0f,
             py::arg("frequency_penalty") = 0.0f, py::arg("presence_penalty") = 0.0f, py::arg("penalty_last_n") = 64,
             py::arg("seed") = LLAMA_DEFAULT_SEED,
             "temperature 0 = greedy. Raises InvalidArgumentError for out-of-range values.")
        .def("sample", &Sampler::sample, py::arg("ctx"), py::arg("i"),
             "Draw a token from output i of ctx's last decode (as Context.logits) and accept it.")
        .def("accept", &Sampler::accept, py::arg("token"), "Record a token as generated (penalty history).")
        .def("distribution", &Sampler::distribution, py::arg("ctx"), py::arg("i"),
             "(token ids, probabilities) left after every stage but the final draw, most likely first; "
             "the one argmax token with probability 1 when greedy. Draws nothing.")
        .def("candidates", &Sampler::candidates, py::arg("ctx"), py::arg("i"),
             "(token ids, logits) of output i after every stage but the final selector (penalties, top-k, top-p, "
             "min-p, temperature applied), in the order the selector walks them: greedy takes the first highest "
             "logit, dist the first token whose cumulative softmax reaches its uniform draw. Draws nothing.")
        .def("clone", [](const Sampler & s) { return Sampler(s); }, "An independent copy, RNG and history included.")
        .def("reset", [](Sampler & s) {
            Sampler::Busy busy(s);
            llama_sampler_reset(s.chain());
        }, "Forget history; restart the RNG.")
        .def_property_readonly("greedy", &Sampler::greedy)
        .def_property_readonly("seed", [](const Sampler & s) { return llama_sampler_get_seed(s.chain()); });
}

}  // namespace hyspec
