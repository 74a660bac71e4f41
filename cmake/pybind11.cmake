# pybind11 headers from the environment's pybind11 package (a build requirement).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import pybind11; print(pybind11.get_include())"
  OUTPUT_VARIABLE PYBIND11_INCLUDE_DIR RESULT_VARIABLE _pb_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _pb_rc EQUAL 0)
  message(FATAL_ERROR "kvcache needs pybind11 in the build environment (pip install pybind11)")
endif()
add_library(kvcache_pybind11 INTERFACE)
target_include_directories(kvcache_pybind11 SYSTEM INTERFACE "${PYBIND11_INCLUDE_DIR}")
