# Locate the installed torch by asking it, rather than through TorchConfig.cmake: a CUDA build of
# torch's CMake config insists on a full CUDA toolkit (nvrtc, cuBLAS, ... headers and libraries) that
# an extension of ours never uses. We need only headers, c10/torch_cpu, and for CUDA c10_cuda.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import os, torch; r = os.path.dirname(torch.__file__); print(torch.__version__.split('+')[0]); print(os.path.join(r, 'include')); print(os.path.join(r, 'lib')); print(int(torch.compiled_with_cxx11_abi())); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _torch_info
  RESULT_VARIABLE _torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "kvcache needs torch installed in the build environment "
                      "(pip install --no-build-isolation . into an environment with torch)")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 TORCH_VERSION)
list(GET _torch_info 1 TORCH_INCLUDE_DIR)
list(GET _torch_info 2 TORCH_LIBRARY_DIR)
list(GET _torch_info 3 TORCH_CXX11_ABI)
list(LENGTH _torch_info _n)
set(TORCH_CUDA_VERSION "")
if(_n GREATER 4)
  list(GET _torch_info 4 TORCH_CUDA_VERSION)
endif()
message(STATUS "kvcache: torch ${TORCH_VERSION} at ${TORCH_LIBRARY_DIR} (CUDA '${TORCH_CUDA_VERSION}')")

# NO_CACHE: a build tree reused with another environment must not keep the old torch's libraries.
find_library(_kvc_c10 c10 PATHS "${TORCH_LIBRARY_DIR}" NO_DEFAULT_PATH NO_CACHE REQUIRED)
find_library(_kvc_torch_cpu torch_cpu PATHS "${TORCH_LIBRARY_DIR}" NO_DEFAULT_PATH NO_CACHE REQUIRED)
find_library(_kvc_torch_python torch_python PATHS "${TORCH_LIBRARY_DIR}" NO_DEFAULT_PATH NO_CACHE REQUIRED)

add_library(kvcache_torch INTERFACE)
target_include_directories(kvcache_torch SYSTEM INTERFACE
  "${TORCH_INCLUDE_DIR}" "${TORCH_INCLUDE_DIR}/torch/csrc/api/include")
target_compile_definitions(kvcache_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI})
target_link_libraries(kvcache_torch INTERFACE "${_kvc_c10}" "${_kvc_torch_cpu}")

# Tensors handed to Python without a round trip through Python code (THPVariable_Wrap): only the
# prefix cache's fast path (prefix_pybind.cpp) needs it.
add_library(kvcache_torch_python INTERFACE)
target_link_libraries(kvcache_torch_python INTERFACE "${_kvc_torch_python}")

if(TORCH_CUDA_VERSION)
  add_library(kvcache_torch_cuda INTERFACE)
  find_library(_kvc_c10_cuda c10_cuda PATHS "${TORCH_LIBRARY_DIR}" NO_DEFAULT_PATH NO_CACHE REQUIRED)
  target_link_libraries(kvcache_torch_cuda INTERFACE "${_kvc_c10_cuda}")
endif()
