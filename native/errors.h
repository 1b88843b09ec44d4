// Typed errors of the worker boundary and the llama.cpp log hook.
//
// Every failure that llama.cpp reports (a return code, a null handle, a false) is turned into
// one of these C++ exceptions; module.cpp maps each to a Python exception class of the same
// name (all subclasses of hyspec._native.HyspecError). Messages say what to do.
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace hyspec {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};
// A GGUF that is missing, unreadable or that llama.cpp refuses to load.
struct ModelLoadError : Error { using Error::Error; };
// A bad argument: token outside the vocabulary, sequence id >= n_seq_max, mismatched array
// lengths, positions that break llama.cpp's batch rules. Also a Python ValueError.
struct InvalidArgumentError : Error { using Error::Error; };
// llama_decode failed; `code` is llama's return value.
struct DecodeError : Error {
    int code;
    DecodeError(const std::string & msg, int code) : Error(msg), code(code) {}
};
// llama_decode found no room in the context (return code 1).
struct NoSpaceError : DecodeError { using DecodeError::DecodeError; };
// A sequence state that could not be read or restored.
struct StateError : Error { using Error::Error; };
// A method called on a closed Model or Context.
struct ClosedError : Error { using Error::Error; };
// A Context entered by a second thread while another is inside it.
struct ConcurrentUseError : Error { using Error::Error; };
// A model without a usable chat template.
struct TemplateError : Error { using Error::Error; };
// llama_model_quantize failed.
struct QuantizeError : Error { using Error::Error; };

// Installs the llama.cpp/ggml log callback: whole messages at or above the threshold go to the
// Python handler set with set_log_handler (or to stderr without one), and the last error line
// of the calling thread is kept for exception messages.
void install_log_hook();
// 0 debug, 1 info, 2 warn, 3 error, 4 none.
void set_log_threshold(int level);
// handler(level, message): level 0 debug .. 3 error; None goes back to stderr. Called with the
// GIL taken, from whichever thread llama.cpp logs on; never during interpreter shutdown.
void set_log_handler(const pybind11::object & handler);
// The last error line llama.cpp logged on this thread since clear_last_log_error().
std::string last_log_error();
void clear_last_log_error();
// Appends ": <last llama.cpp error>" to msg when there is one.
std::string with_llama_reason(const std::string & msg);

void register_errors(pybind11::module_ & m);

}  // namespace hyspec
