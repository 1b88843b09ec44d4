#include "errors.h"

#include "llama.h"

#include <atomic>
#include <cstdio>

namespace py = pybind11;

namespace hyspec {
namespace {

std::atomic<int> g_threshold{4};
thread_local std::string t_last_error;
thread_local std::string t_current;  // the message being assembled (pieces come as CONT)
thread_local int t_current_level = GGML_LOG_LEVEL_NONE;

int rank(int ggml_level) {
    switch (ggml_level) {
        case GGML_LOG_LEVEL_DEBUG: return 0;
        case GGML_LOG_LEVEL_INFO: return 1;
        case GGML_LOG_LEVEL_WARN: return 2;
        case GGML_LOG_LEVEL_ERROR: return 3;
        default: return 1;
    }
}

// The Python log handler (a strong reference, touched only with the GIL held) and whether
// one is set (read without the GIL, before deciding to take it).
PyObject * g_handler = nullptr;
std::atomic<bool> g_has_handler{false};

bool python_usable() {
    if (!Py_IsInitialized()) return false;
#if PY_VERSION_HEX >= 0x030D0000
    return !Py_IsFinalizing();
#else
    return !_Py_IsFinalizing();
#endif
}

void to_python(int level, const std::string & message) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject * handler = g_handler;
    if (handler) {
        Py_INCREF(handler);
        PyObject * text = PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()), "replace");
        PyObject * result = text ? PyObject_CallFunction(handler, "iO", level, text) : nullptr;
        if (!result) PyErr_WriteUnraisable(handler);
        Py_XDECREF(result);
        Py_XDECREF(text);
        Py_DECREF(handler);
    }
    PyGILState_Release(gil);
}

// llama.cpp logs a message in pieces (CONT continues the last one); a message is complete when
// it ends with a newline.
void log_hook(enum ggml_log_level level, const char * text, void * /*user_data*/) {
    if (level != GGML_LOG_LEVEL_CONT) {
        t_current_level = level;
        t_current.clear();
    }
    t_current += text ? text : "";
    if (t_current_level == GGML_LOG_LEVEL_ERROR && !t_current.empty()) {
        std::string line = t_current;
        while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
        t_last_error = line;
    }
    if (t_current.empty() || t_current.back() != '\n') return;  // more pieces to come
    std::string message;
    message.swap(t_current);
    const int r = rank(t_current_level);
    if (r < g_threshold.load(std::memory_order_relaxed)) return;
    if (g_has_handler.load(std::memory_order_acquire)) {
        if (python_usable()) {
            message.pop_back();
            to_python(r, message);
        }
        return;
    }
    std::fputs(message.c_str(), stderr);
}

// Python exception classes, created once at import.
PyObject * py_base = nullptr;
PyObject * py_model_load = nullptr;
PyObject * py_invalid = nullptr;
PyObject * py_decode = nullptr;
PyObject * py_no_space = nullptr;
PyObject * py_state = nullptr;
PyObject * py_closed = nullptr;
PyObject * py_concurrent = nullptr;
PyObject * py_template = nullptr;
PyObject * py_quantize = nullptr;

PyObject * new_exception(py::module_ & m, const char * name, PyObject * bases, const char * doc) {
    std::string qualified = std::string("hyspec._native.") + name;
    PyObject * cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
    if (!cls) throw py::error_already_set();
    m.add_object(name, py::reinterpret_borrow<py::object>(cls));
    return cls;
}

void raise_decode(PyObject * cls, const DecodeError & e) {
    py::object instance = py::reinterpret_borrow<py::object>(cls)(e.what());
    instance.attr("code") = e.code;
    PyErr_SetObject(cls, instance.ptr());
}

}  // namespace

void install_log_hook() { llama_log_set(log_hook, nullptr); }
void set_log_threshold(int level) { g_threshold.store(level); }

void set_log_handler(const py::object & handler) {
    PyObject * old = g_handler;
    if (handler.is_none()) {
        g_has_handler.store(false, std::memory_order_release);
        g_handler = nullptr;
    } else {
        g_handler = handler.inc_ref().ptr();
        g_has_handler.store(true, std::memory_order_release);
    }
    Py_XDECREF(old);
}
std::string last_log_error() { return t_last_error; }
void clear_last_log_error() { t_last_error.clear(); }

std::string with_llama_reason(const std::string & msg) {
    const std::string reason = last_log_error();
    return reason.empty() ? msg : msg + " (llama.cpp: " + reason + ")";
}

void register_errors(py::module_ & m) {
    py_base = new_exception(m, "HyspecError", PyExc_Exception, "Base class of every error raised by hyspec._native.");
    py::tuple invalid_bases = py::make_tuple(py::handle(py_base), py::handle(PyExc_ValueError));
    py_model_load = new_exception(m, "ModelLoadError", py_base, "A GGUF file is missing, unreadable or refused by llama.cpp.");
    py_invalid = new_exception(m, "InvalidArgumentError", invalid_bases.ptr(),
                               "A bad argument: token id, sequence id, array lengths, positions, sizes.");
    py_decode = new_exception(m, "DecodeError", py_base, "llama_decode failed; `code` holds llama.cpp's return value.");
    py_no_space = new_exception(m, "NoSpaceError", py_decode,
                                "llama_decode found no room in the context for the batch (code 1).");
    py_state = new_exception(m, "StateError", py_base, "A sequence state could not be read or restored.");
    py_closed = new_exception(m, "ClosedError", py_base, "The Model or Context was closed.");
    py_concurrent = new_exception(m, "ConcurrentUseError", py_base,
                                  "A Context was used by two threads at once; give each thread its own.");
    py_template = new_exception(m, "TemplateError", py_base, "The model has no usable chat template.");
    py_quantize = new_exception(m, "QuantizeError", py_base, "llama_model_quantize failed.");

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const NoSpaceError & e) {
            raise_decode(py_no_space, e);
        } catch (const DecodeError & e) {
            raise_decode(py_decode, e);
        } catch (const ModelLoadError & e) {
            PyErr_SetString(py_model_load, e.what());
        } catch (const InvalidArgumentError & e) {
            PyErr_SetString(py_invalid, e.what());
        } catch (const StateError & e) {
            PyErr_SetString(py_state, e.what());
        } catch (const ClosedError & e) {
            PyErr_SetString(py_closed, e.what());
        } catch (const ConcurrentUseError & e) {
            PyErr_SetString(py_concurrent, e.what());
        } catch (const TemplateError & e) {
            PyErr_SetString(py_template, e.what());
        } catch (const QuantizeError & e) {
            PyErr_SetString(py_quantize, e.what());
        } catch (const Error & e) {
            PyErr_SetString(py_base, e.what());
        }
    });
}

}  // namespace hyspec
